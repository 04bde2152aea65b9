"""A user's own task file (`eval run --task FILE.jsonl`) on the tiny pair: validation that names the
line and field, scores equal to the built-in path and to full passes, disjointness by prompt hash,
resume refusal on an edited file, and the CLI from calibration to report."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import pytest
import torch

from rarecache import LLM
from rarecache.cli import main
from rarecache.errors import RarecacheError
from rarecache.eval.arms import parse_arms
from rarecache.eval.results import load_results, run_meta
from rarecache.eval.run import run_task
from rarecache.eval.tasks import open_task
from rarecache.eval.tasks.base import Item, Task
from rarecache.eval.tasks.multiple_choice import OlmesChoice
from rarecache.eval.tasks.custom import HASH, FileTask, headline, prompt_sha256, read_task_file
from rarecache.transfer.mapper import Mapper

from .conftest import error_of

WORDS = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()
CHOICE = [{"id": f"q{i}", "context": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)),
           "choices": ["the quick fox", "lazy dog jumps over", "add"], "gold": i % 3} for i in range(4)]
BPB = [{"context": "def add(a, b):", "continuation": "    return a + b"},
       {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the lazy dog"},
                     {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over the"}],
        "continuation": "quick brown fox, Héllo wörld €"}]


def write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def models(pair_dir, fitted):
    return LLM(pair_dir / "src"), LLM(pair_dir / "tgt"), fitted[2]


GOOD = json.dumps(CHOICE[0])
MISTAKES = [
    ([GOOD, "", '{"context": "x", "choices": ["a", "b"], "gold": 0'], r"line 3: not valid JSON"),
    (["[1, 2]"], "line 1: expected a JSON object, got list"),
    ([GOOD, '{"choices": ["a", "b"], "gold": 0}'], r"line 2: missing field context \(or messages\)"),
    (['{"context": "x", "messages": [], "choices": ["a", "b"], "gold": 0}'],
     "line 1: give field context or messages, not both"),
    (['{"context": "x"}'], r"line 1: missing field choices \(multiple-choice\) or continuation \(bits-per-byte\)$"),
    (['{"text": "x"}'], r"line 1: missing field .*\{\"text\": \.\.\.\} lines belong in a --calibration file"),
    (['{"context": "x", "choices": ["a", "b"], "continuation": "c"}'], "line 1: fields choices and continuation"),
    (['{"context": "x", "choices": [], "gold": 0}'], "line 1: field choices must be a list of at least 2 strings"),
    (['{"context": "x", "choices": ["a"], "gold": 0}'], "line 1: field choices must be a list of at least 2"),
    (['{"context": "x", "choices": "ab", "gold": 0}'], "line 1: field choices must be a list"),
    (['{"context": "x", "choices": ["a", ""], "gold": 0}'], r"line 1: field choices\[1\] must be a non-empty string"),
    (['{"context": "x", "choices": ["a", "b"]}'], "line 1: missing field gold"),
    (['{"context": "x", "choices": ["a", "b"], "gold": "1"}'],
     'line 1: field gold must be an integer index \\(got "1"\\)'),
    (['{"context": "x", "choices": ["a", "b"], "gold": true}'], "line 1: field gold must be an integer index"),
    (['{"context": "x", "choices": ["a", "b"], "gold": 1.0}'], "line 1: field gold must be an integer index"),
    ([GOOD, '{"context": "x", "choices": ["a", "b"], "gold": 2}'],
     r"line 2: field gold 2 is out of range for 2 choices \(0-1\)"),
    (['{"context": "x", "choices": ["a", "b"], "gold": -1}'], "line 1: field gold -1 is out of range"),
    ([GOOD, GOOD.replace('"q0"', '"q1"'), '{"context": "x", "continuation": "y"}'],
     r"line 3: a bits-per-byte line in a multiple-choice file \(line 1\): all lines must be one form"),
    ([GOOD, json.dumps({**CHOICE[1], "id": "q0"})], "line 2: field id: id 'q0' is also on line 1; ids must be unique"),
    (['{"context": "x", "continuation": "y"}', "", '{"context": "x", "continuation": "y"}'],
     r"line 3: field id: the same content \(no id given: ids hash the content\) is also on line 1"),
    (['{"context": "x", "continuation": "y", "id": true}'],
     "line 1: field id must be a non-empty string or an integer"),
    (['{"context": "x", "continuation": "y", "subject": "math"}'],
     "line 1: unknown field subject \\(a bits-per-byte line has context, continuation, id, messages\\)"),
    (['{"context": "", "continuation": "y"}'], "line 1: field context must be a non-empty string"),
    (['{"context": "x", "continuation": 3}'], "line 1: field continuation must be a non-empty string \\(got 3\\)"),
    (['{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "continuation": "z"}'],
     "line 1: field messages must end in a user turn"),
    (['{"messages": [{"role": "bot", "content": "x"}], "continuation": "z"}'],
     r'line 1: field messages\[0\].role must be one of system, user, assistant \(got "bot"\)'),
    (['{"messages": [{"role": "user"}], "continuation": "z"}'], r"line 1: field messages\[0\] must be an object"),
    (['{"messages": "hi", "continuation": "z"}'], "line 1: field messages must be a non-empty list"),
    (["", "  "], "no items \\(the file is empty\\)"),
    ([], "no items \\(the file is empty\\)"),
]


@pytest.mark.parametrize("lines, message", MISTAKES)
def test_task_file_mistakes_name_the_file_line_and_field(tmp_path, lines, message):
    path = write(tmp_path / "mine.jsonl", lines)
    with pytest.raises(RarecacheError, match=f"^{re.escape(path)}:? {message}"):
        read_task_file(path)


def test_unreadable_files_are_clear_errors(tmp_path):
    (tmp_path / "bin.jsonl").write_bytes(b'{"context": "x", "continuation": "\xff"}\n')
    with pytest.raises(RarecacheError, match=r"bin.jsonl: not UTF-8 text \(byte 34\)"):
        read_task_file(tmp_path / "bin.jsonl")
    with pytest.raises(RarecacheError, match="unknown task 'nope.jsonl': not one of gsm8k, .*, and no such file"):
        open_task("nope.jsonl")
    with pytest.raises(RarecacheError, match="--calibration goes with a task file; mmlu has"):
        open_task("mmlu", calibration=tmp_path / "c.jsonl")


def test_file_items_hash_the_content_and_name_the_task(tmp_path):
    task = open_task(write(tmp_path / "mine.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in CHOICE]))
    assert isinstance(task, FileTask) and task.name == "mine.jsonl" and task.metric == "correct_norm"
    assert task.kind == "likelihood" and task.chance == pytest.approx(1 / 3)
    items = task.items()
    want = hashlib.sha256(json.dumps({"messages": [{"role": "user", "content": CHOICE[0]["context"]}],
                                      "choices": CHOICE[0]["choices"], "gold": 0}, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()[:16]
    assert items[0].id == want and len({i.id for i in items}) == 4
    assert items[0].messages == ({"role": "user", "content": CHOICE[0]["context"]},)
    assert items[0].continuations == tuple(CHOICE[0]["choices"]) and [i.gold for i in items] == [0, 1, 2, 0]
    # the disjointness key is the prompt alone: a context and the equal user turn given as messages agree
    same = read_task_file(write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": CHOICE[0]["context"]}],
                                                        "continuation": "x"}]))
    assert same.items[0].extra["prompt_sha256"] == items[0].extra["prompt_sha256"]
    assert prompt_sha256(items[0].messages) == hashlib.sha256(json.dumps(
        [{"content": CHOICE[0]["context"], "role": "user"}], separators=(",", ":")).encode()).hexdigest()


class SameAsOlmes(OlmesChoice):
    """The built-in multiple-choice path over the same items: a user-turn context, choices as replies."""

    name = "same"

    def items(self):
        return [Item(r["id"], ({"role": "user", "content": r["context"]},), r["gold"], {}, tuple(r["choices"]))
                for r in CHOICE]

    def calibration_items(self):
        return []


def _full_pass(llm: LLM, messages, continuation: str) -> float:
    """Total log-probability of `continuation` after the chat prompt, from one forward pass over both."""
    prompt = llm.encode(list(messages))
    cont = llm.tokenizer.encode(continuation, add_special_tokens=False)
    ids = prompt + cont
    logits = llm.runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None], llm.runner.new_cache(1, len(ids)),
                                logits_at="all").logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)  # (len(cont), V)
    return lp.gather(1, torch.tensor(cont)[:, None]).sum().item()


def test_choice_file_scores_as_the_builtin_path_and_full_passes(models, tmp_path):
    source, target, mapper = models
    arms = parse_arms(["target", "source", "1:rank", "0.3:rank"], ("",))
    mine = open_task(write(tmp_path / "mine.jsonl", CHOICE))
    got = load_results(run_task(mine, mine.items(), source, target, mapper, arms, tmp_path / "a.jsonl", progress=False))
    same = SameAsOlmes()
    want = load_results(run_task(same, same.items(), source, target, mapper, arms, tmp_path / "b.jsonl",
                                 progress=False))
    assert [{**r, "task": "-"} for r in got] == [{**r, "task": "-"} for r in want]  # every field, every arm
    assert {r["task"] for r in got} == {"mine.jsonl"}
    by = {(r["item"], r["arm"]): r for r in got}
    for row in CHOICE:
        msgs = [{"role": "user", "content": row["context"]}]
        for arm, llm in (("target", target), ("source", source)):
            lps = [_full_pass(llm, msgs, c) for c in row["choices"]]
            assert by[(row["id"], arm)]["logprobs"] == pytest.approx(lps, abs=1e-3)
        r = by[(row["id"], "rho=0.3/rank")]
        norm = [lp / len(c) for lp, c in zip(r["logprobs"], row["choices"])]
        assert r["prediction_norm"] == max(range(3), key=norm.__getitem__)
        assert r["correct_norm"] == (r["prediction_norm"] == row["gold"]) and r["gold"] == row["gold"]
    assert headline(got) == ("correct_norm", pytest.approx(1 / 3))


def test_bpb_file_is_bits_per_byte_of_the_continuation(models, tmp_path):
    source, target, mapper = models
    task = open_task(write(tmp_path / "cont.jsonl", BPB))
    assert (task.metric, task.chance) == ("bpb", 0.0)
    rows = load_results(run_task(task, task.items(), source, target, mapper, parse_arms(["target", "source"], ("",)),
                                 tmp_path / "r.jsonl", progress=False))
    by = {(r["item"], r["arm"]): r for r in rows}
    for item, line in zip(task.items(), BPB):
        msgs = line.get("messages") or [{"role": "user", "content": line["context"]}]
        n_bytes = len(line["continuation"].encode())
        for arm, llm in (("target", target), ("source", source)):
            r = by[(item.id, arm)]
            assert r["bytes"] == n_bytes and r["gold"] is None
            assert r["bpb"] == pytest.approx(-_full_pass(llm, msgs, line["continuation"]) / (math.log(2) * n_bytes),
                                             abs=1e-4)
    assert by[(task.items()[1].id, "target")]["bytes"] == 34  # 30 characters: é, ö take 2 bytes, € 3
    assert headline(rows) == ("bpb", 0.0)


def test_calibration_is_refused_by_prompt_content_not_ids(tmp_path):
    path = write(tmp_path / "mine.jsonl", CHOICE)
    leak = [{"text": "nothing evaluated"},
            {"id": "other-id", "text": CHOICE[2]["context"]}]  # another id and form, the same prompt
    task = open_task(path, calibration=write(tmp_path / "cal.jsonl", leak))
    with pytest.raises(RarecacheError, match=r"cal.jsonl: 1 line\(s\) have the prompt of an evaluated item "
                                             r"\(sha256 of the prompt\): line 2 = .*mine.jsonl line 3"):
        task.calibration_corpus()
    with pytest.raises(RarecacheError, match="--calibration CAL.jsonl"):
        open_task(path).calibration_corpus()
    cal = [{"text": "the fox"}, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                              {"role": "user", "content": "c"}], "continuation": "d"}]
    with pytest.raises(RarecacheError, match="line 2: a bits-per-byte line in a text file"):
        open_task(path, calibration=write(tmp_path / "mixed.jsonl", cal)).calibration_corpus()
    corpus = open_task(path, calibration=write(tmp_path / "ok.jsonl", cal[:1])).calibration_corpus()
    assert corpus.name == "task:mine.jsonl" and corpus.chat and corpus.documents == ("the fox",)
    assert corpus.ids == (HASH + prompt_sha256([{"role": "user", "content": "the fox"}]),)


def test_a_map_that_read_an_evaluated_prompt_is_refused_whatever_it_was_fitted_for(models, tmp_path):
    source, target, mapper = models
    task = open_task(write(tmp_path / "mine.jsonl", CHOICE))
    seen = HASH + task.items()[1].extra["prompt_sha256"]
    info = dataclasses.replace(mapper.info, corpus={"name": "task:someone-else.jsonl"},
                               calibration={**mapper.info.calibration, "document_ids": ["x", seen]})
    with pytest.raises(RarecacheError, match=r"mine.jsonl: the map \(calibrated on task:someone-else.jsonl\) was "
                                             r"fitted on the prompts of 1 evaluated item\(s\), by sha256 of the "
                                             r"prompt: line 2 \(id q1\);"):
        run_task(task, task.items(), source, target, Mapper(info, mapper.sides), parse_arms(["target"], ("",)),
                 tmp_path / "r.jsonl", progress=False)
    task.check_map(Mapper(info, mapper.sides), task.items()[2:])  # the other items are fine


def test_resuming_with_an_edited_task_file_is_refused(models, tmp_path):
    source, target, mapper = models
    (tmp_path / "m.safetensors").write_bytes(b"map")  # only its hash is read here
    arms, out = parse_arms(["target"], ("",)), tmp_path / "r.jsonl"

    def run(path):
        task = open_task(str(path))
        return run_task(task, task.items(), source, target, mapper, arms, out, progress=False,
                        meta=run_meta(task, source, target, {"": tmp_path / "m.safetensors"}, "float32", None))

    first = tmp_path / "mine.jsonl"
    write(first, CHOICE)
    run(first)
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["task"] == "mine.jsonl"
    assert meta["task_file"] == {"file": str(first), "sha256": hashlib.sha256(first.read_bytes()).hexdigest()}
    moved = tmp_path / "elsewhere" / "mine.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(first.read_bytes())
    run(moved)  # the same content elsewhere resumes
    write(first, [*CHOICE[:3], {**CHOICE[3], "gold": 1}])
    with pytest.raises(RarecacheError, match="mine.jsonl is not the file its results came from"):
        run(first)


def test_headline_falls_back_to_correct_and_builtin_tasks_record_no_file():
    rows = [{"task": "x", "item": "a", "arm": "target", "correct": True}]
    assert headline(rows) == ("correct", 0.0)
    assert Task.record(Task()) is None


def test_cli_calibrate_run_report_and_refusals(pair_dir, tmp_path, capsys):
    pair = ["--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--dtype", "float32"]
    fit = ["--tokens", "160", "--heldout-tokens", "0", "--seq-len", "48", "--k", "2", "--rank", "4"]
    task = write(tmp_path / "mine.jsonl", CHOICE)
    cal = write(tmp_path / "cal.jsonl", [{"text": " ".join(WORDS[j:] + WORDS[:j])} for j in range(6)])
    assert main(["calibrate", *pair, *fit, "--task", task, "--calibration", cal, "--out", str(tmp_path / "m.st")]) == 0
    info = Mapper.load(tmp_path / "m.st").info
    assert info.corpus["name"] == "task:mine.jsonl"
    used = info.calibration["document_ids"]
    assert used and used == [HASH + i.extra["prompt_sha256"]
                             for i in read_task_file(cal, ("text",)).items][: len(used)]
    capsys.readouterr()

    def run_args(task_file, map_file="m.st", out="r.jsonl"):
        return ["eval", "run", "--task", task_file, *pair, "--map", str(tmp_path / map_file), "--rhos", "0", "1",
                "--selectors", "random", "--limit", "4", "--out", str(tmp_path / out)]

    run = run_args(task)
    assert main(run) == 0
    rows = load_results(tmp_path / "r.jsonl")
    assert len(rows) == 4 * 5 and {r["task"] for r in rows} == {"mine.jsonl"}
    by = {(r["item"], r["arm"]): r for r in rows}
    for r in CHOICE:
        assert by[(r["id"], "rho=1/rank")]["logprobs"] == pytest.approx(by[(r["id"], "target")]["logprobs"], abs=1e-3)
    assert "**mine.jsonl: 4 items" in capsys.readouterr().out
    assert (tmp_path / "r.md").is_file()
    assert main(["eval", "report", str(tmp_path / "r.jsonl")]) == 0
    out = capsys.readouterr().out
    sha = json.loads((tmp_path / "r.meta.json").read_text())["maps"][""]["sha256"]
    assert "| correct_norm |" in out and f"| rho=1/rank[{sha[:8]}] | 4 |" in out  # the run's one map, by its sha256

    def refused(argv, message):
        assert main(argv) == 2
        err = error_of(capsys.readouterr().err)
        assert err.startswith("rarecache: error:") and message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1

    write(tmp_path / "mine.jsonl", [*CHOICE[:3], {**CHOICE[3], "choices": ["x", "y"], "gold": 0}])
    refused(run, "mine.jsonl is not the file its results came from")
    write(tmp_path / "mine.jsonl", CHOICE)
    # a map calibrated for another task file on data holding one of ours is refused by content
    other = write(tmp_path / "other.jsonl", [{"context": "unrelated words", "continuation": "x"}])
    leak = write(tmp_path / "leak.jsonl", [{"text": CHOICE[0]["context"]}, {"text": "the fox"}])
    assert main(["calibrate", *pair, *fit, "--task", other, "--calibration", leak,
                 "--out", str(tmp_path / "l.st")]) == 0
    capsys.readouterr()
    refused(run_args(task, "l.st", "r2.jsonl"),
            "was fitted on the prompts of 1 evaluated item(s), by sha256 of the prompt: line 1 (id q0)")
    refused(["calibrate", *pair, *fit, "--task", task, "--calibration", leak, "--out", str(tmp_path / "x.st")],
            "leak.jsonl: 1 line(s) have the prompt of an evaluated item")
    refused(["calibrate", *pair, *fit, "--calibration", cal, "--out", str(tmp_path / "x.st")],
            "--calibration is a task file's data")
    write(tmp_path / "bad.jsonl", [GOOD, '{"context": "x", "choices": ["a", "b"], "gold": 5}'])
    refused(run_args(str(tmp_path / "bad.jsonl")), "bad.jsonl line 2: field gold 5 is out of range")
    refused(run_args(str(tmp_path / "nope.jsonl")), "unknown task")
    assert not (tmp_path / "x.st").exists()
