"""The `rarecache` command on a tiny model: output equals the API, mistakes are one-line errors."""

from __future__ import annotations

import json

import pytest

from rarecache import LLM, SamplingConfig
from rarecache.cli import main

from .conftest import make_tiny


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
    (["generate", "--model", "MODEL", "--max-new-tokens", "1000", "hi"], "exceeds the model's 256"),
    (["generate", "--model", "MODEL", ""], "the prompt is empty"),
    (["pull", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_user_mistakes_are_one_line_errors(model_dir, capsys, argv, message):
    argv = [str(model_dir) if a == "MODEL" else a for a in argv]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("rarecache: error:") and message in err
    assert "Traceback" not in err


def test_missing_weights_named(model_dir, capsys):
    (model_dir / "model.safetensors").unlink()
    assert main(["generate", "--model", str(model_dir), "hi"]) == 2
    assert "no .safetensors weights" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("pull", "generate", "models"))


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
