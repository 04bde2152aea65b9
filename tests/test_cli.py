"""The `rarecache` command on a tiny model: output equals the API, mistakes are one-line errors."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from rarecache import LLM, SamplingConfig
from rarecache.cli import build_parser, main
from rarecache.eval.tasks import TASKS

from .conftest import error_of, make_tiny


@pytest.fixture()
def model_dir(tok_dir):
    make_tiny("qwen2", tok_dir, vocab_size=400)
    return tok_dir


def test_generate_prints_what_the_api_returns(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--dtype", "float32", "--chat",
                 "--max-new-tokens", "8", "--json", "hello there", "def add"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(model_dir)
    want = llm.generate([[{"role": "user", "content": p}] for p in ("hello there", "def add")],
                        SamplingConfig(max_new_tokens=8))
    assert [x["text"] for x in lines] == [w.text for w in want]
    assert [x["prompt_tokens"] for x in lines] == [w.prompt_tokens for w in want]


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/model", "hi"], "model"),
    (["generate", "--model", "MODEL", "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--model", "MODEL", "--temperature", "nan", "hi"], "temperature"),
    (["generate", "--model", "MODEL", "--temperature", "inf", "hi"], "temperature"),
    (["generate", "--model", "MODEL", "--top-p", "nan", "hi"], "top_p"),
    (["generate", "--model", "MODEL", "--seed", str(2**70), "hi"], "seed"),
    (["generate", "--model", "MODEL", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["generate", "--model", "MODEL", "--max-new-tokens", "1000", "hi"], "exceeds the model's 256"),
    (["generate", "--model", "MODEL", ""], "the prompt is empty"),
    (["pull", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_user_mistakes_are_one_line_errors(model_dir, capsys, argv, message):
    argv = [str(model_dir) if a == "MODEL" else a for a in argv]
    code = main(argv)
    err = error_of(capsys.readouterr().err)
    assert code == 2 and err.startswith("rarecache: error:") and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("temperature", ["1e-40", "5e-324", "1e-300"])
def test_tiny_temperatures_are_greedy(model_dir, capsys, temperature):
    base = ["generate", "--model", str(model_dir), "--dtype", "float32", "--max-new-tokens", "6", "--json", "hi"]
    assert main(base) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", temperature, "--top-p", "1e-300"]) == 0
    assert capsys.readouterr().out == greedy


def test_missing_weights_named(model_dir, capsys):
    (model_dir / "model.safetensors").unlink()
    assert main(["generate", "--model", str(model_dir), "hi"]) == 2
    assert "no .safetensors weights" in capsys.readouterr().err


COMMANDS = ("demo", "models", "pull", "generate", "calibrate", "refit", "mlp", "refine", "inspect", "ppl", "eval", "serve",
            "bench")


def _parsers(parser, words=(), summary=None):
    """Every (sub)parser under `parser`: its command words, itself, and the help line its parent lists."""
    yield words, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                yield from _parsers(child, (*words, name), helps[name])


def _flat(text: str) -> str:
    """Without its whitespace: help wraps lines at spaces and after hyphens."""
    return "".join(text.split())


def test_help_lists_every_command_with_its_summary(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rarecache [-h] COMMAND ...")
    assert "Cross-model KV-cache handoff" in out
    assert re.findall(r"^    (\S+)", out, re.M) == list(COMMANDS)  # each once, in this order
    helps = {words[0]: h for words, _, h in _parsers(build_parser()) if len(words) == 1}
    assert set(helps) == set(COMMANDS) and all(helps.values())
    assert all(_flat(f"{c} {helps[c]}") in _flat(out) for c in COMMANDS)


def test_every_subcommand_help(capsys):
    """`rarecache ... --help` works for every command and action, and shows what its parser holds."""
    seen = []
    for words, parser, summary in _parsers(build_parser()):
        with pytest.raises(SystemExit) as e:
            main([*words, "--help"])
        assert e.value.code == 0 and (summary or not words), words  # every command has its one-line summary
        out = _flat(capsys.readouterr().out)
        assert out.startswith(_flat(f"usage: rarecache {' '.join(words)}".rstrip() + " [-h]")), words
        if parser.description:
            assert _flat(parser.description) in out, words
        for action in parser._actions:
            if action.option_strings and action.help:
                assert _flat(action.help) in out, (words, action.option_strings)
        seen.append(" ".join(words))
    assert set(seen) >= {"eval run", "eval report", *(f"bench {b}" for b in ("map", "handoff", "serve", "load", "soak",
                                                                             "ablate", "gpu"))}
    with pytest.raises(SystemExit):
        main(["eval", "run", "--help"])
    assert _flat(f"--task TASK one of: {', '.join(TASKS)}") in _flat(capsys.readouterr().out)


def test_help_imports_no_model_code():
    """Every --help text comes without importing torch, the model code or the evaluation tasks."""
    commands = [list(words) for words, _, _ in _parsers(build_parser())]
    code = ("import contextlib, io, json, sys\n"
            "from rarecache.cli import main\n"
            "for words in json.loads(sys.argv[1]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main([*words, '--help'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'tokenizers')\n"
            "             or m.startswith(('rarecache.eval', 'rarecache.engine', 'rarecache.transfer'))))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                         check=True).stdout
    assert len(commands) == 32 and out.splitlines()[-1] == "[]"


def test_served_model_names(tmp_path, monkeypatch):
    from rarecache.serve.names import model_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert model_id("qwen2.5-coder-0.5b-instruct") == "qwen2.5-coder-0.5b-instruct"  # a bundled name as given
    assert model_id(str(tmp_path / "models" / "small.gguf")) == "small"
    assert model_id(str(tmp_path / "models" / "big")) == "big" and model_id("local") == "local"


def test_eval_report_and_plots(tmp_path, capsys):
    rows = [("a", "target", 1), ("a", "source", 0), ("a", "rho=0/rank", 0), ("a", "rho=0.3/rank", 1),
            ("b", "target", 1), ("b", "source", 1), ("b", "rho=0/rank", 1), ("b", "rho=0.3/rank", 0)]
    res = tmp_path / "gsm.jsonl"
    res.write_text("".join(json.dumps({"task": "gsm8k", "item": i, "arm": a, "correct": bool(c)}) + "\n"
                           for i, a, c in rows))
    assert main(["eval", "report", str(res), "--plots", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "| rho=0.3/rank | 2 | 50.0% |" in out and "| target | 2 | 100.0% |" in out
    assert (tmp_path / "p" / "gsm-vs-rho.png").is_file() and (tmp_path / "p" / "gsm-selectors.png").is_file()
    assert main(["eval", "report", str(tmp_path / "missing.jsonl")]) == 2


def test_eval_report_other_metric(tmp_path, capsys):
    rows = [("a", "target", 1, 0), ("a", "source", 0, 0), ("a", "rho=0.3/rank", 1, 1),
            ("b", "target", 1, 1), ("b", "source", 1, 1), ("b", "rho=0.3/rank", 0, 0)]
    res = tmp_path / "arc.jsonl"
    res.write_text("".join(json.dumps({"task": "arc_challenge", "item": i, "arm": a, "correct": bool(c),
                                       "correct_norm": bool(n)}) + "\n" for i, a, c, n in rows))
    assert main(["eval", "report", str(res)]) == 0  # headline metric: acc_norm
    out = capsys.readouterr().out
    assert "| correct_norm |" in out and "| target | 2 | 50.0% |" in out
    assert main(["eval", "report", str(res), "--metric", "correct", "--plots", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "| correct |" in out and "| target | 2 | 100.0% |" in out and "| source | 2 | 50.0% |" in out
    assert (tmp_path / "p" / "arc-correct-vs-rho.png").is_file()
    assert main(["eval", "report", str(res), "--metric", "bpb"]) == 2
    err = capsys.readouterr().err
    assert "no metric 'bpb'" in err and "correct_norm" in err
