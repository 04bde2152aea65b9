"""The evaluation harness on a tiny pair: resumable runs, disjointness, metrics."""

from __future__ import annotations

import dataclasses

import pytest

from rarecache import LLM, SamplingConfig
from rarecache.errors import RarecacheError
from rarecache.eval.metrics import mean_ci, paired_diff_ci
from rarecache.eval.report import summarise
from rarecache.eval.run import Arm, load_results, run_task
from rarecache.eval.tasks.base import Item, Task
from rarecache.eval.tasks.gsm8k import extract_answer, normalise

from .test_handoff import fitted  # noqa: F401  (fixture)

WORDS = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()


class Toy(Task):
    name = "toy"
    metric = "correct"

    def _all(self):
        return [Item(f"toy-{i}", ({"role": "user", "content": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8))},),
                     WORDS[i % len(WORDS)], {"index": i}) for i in range(8)]

    def items(self):
        return self._all()[:5]

    def calibration_items(self):
        return self._all()[5:]

    def score(self, item, text):
        return {"prediction": text.split()[0] if text.split() else None, "correct": item.gold in text}


ARMS = [Arm.parse(a) for a in ("target", "source", "0:rank", "0.5:random", "1:rank", "0.3:attn-source")]
SAMPLING = SamplingConfig(max_new_tokens=4, ignore_eos=True)


@pytest.fixture()
def models(pair_dir, fitted):  # noqa: F811
    return LLM(pair_dir / "src"), LLM(pair_dir / "tgt"), fitted[2]


def test_resumed_run_gives_the_same_file(models, tmp_path, monkeypatch):
    source, target, mapper = models
    task = Toy()
    whole = run_task(task, task.items(), source, target, mapper, ARMS, tmp_path / "a.jsonl", SAMPLING, False)
    calls = {"n": 0}
    real = Toy.score

    def dying(self, item, text):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt  # killed in the middle of item 3
        return real(self, item, text)

    monkeypatch.setattr(Toy, "score", dying)
    with pytest.raises(KeyboardInterrupt):
        run_task(task, task.items(), source, target, mapper, ARMS, tmp_path / "b.jsonl", SAMPLING, False)
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"task": "toy", "item": "toy-2", "ar')  # a line cut short by the kill
    monkeypatch.setattr(Toy, "score", real)
    run_task(task, task.items(), source, target, mapper, ARMS, tmp_path / "b.jsonl", SAMPLING, False)
    assert whole.read_text() == (tmp_path / "b.jsonl").read_text()
    rows = load_results(whole)
    assert len(rows) == 5 * len(ARMS)
    by = {(r["item"], r["arm"]): r for r in rows}
    for i in range(5):  # ρ = 1 is the target's own prefill: the same greedy answer
        assert by[(f"toy-{i}", "rho=1/rank")]["text"] == by[(f"toy-{i}", "target")]["text"]
        assert by[(f"toy-{i}", "rho=0/rank")]["recomputed"] == 1


def test_overlapping_calibration_is_rejected(models, tmp_path):
    source, target, mapper = models
    task = Toy()
    corpus = task.calibration_corpus()
    assert corpus.ids == ("toy-5", "toy-6", "toy-7") and corpus.chat
    info = dataclasses.replace(mapper.info, corpus={"name": "task:toy"},
                               calibration={**mapper.info.calibration, "document_ids": ["toy-6", "toy-1"]})
    bad = type(mapper)(info, mapper.sides)
    with pytest.raises(RarecacheError, match="1 evaluated item"):
        run_task(task, task.items(), source, target, bad, ARMS[:1], tmp_path / "c.jsonl", SAMPLING, False)

    class Overlapping(Toy):
        def calibration_items(self):
            return self._all()[4:]  # toy-4 is also evaluated

    with pytest.raises(RarecacheError, match="used for calibration"):
        Overlapping().calibration_corpus()


def test_arm_parsing():
    assert Arm.parse("0.3:rank").name == "rho=0.3/rank" and Arm.parse("target").kind == "target"
    assert Arm.parse("0.3:l2-oracle").label == "rho=0.3/l2-oracle (oracle)"
    for bad in ("0.3:magic", "x:rank", "2:rank"):
        with pytest.raises(RarecacheError):
            Arm.parse(bad)


def test_gsm8k_answer_extraction():
    assert extract_answer("3 + 4 = 7. So the answer is 7.") == "7"
    assert extract_answer("The answer is $1,250.00") == "1250"
    assert extract_answer("so she has 18 dollars left") == "18"
    assert extract_answer("no numbers") is None
    assert normalise("-3.50") == "-3.5" and normalise("42.") == "42"


def test_metrics_by_hand():
    m, lo, hi = mean_ci([1, 0, 1, 1])
    assert m == 0.75 and 0 <= lo <= m <= hi <= 1
    assert mean_ci([1, 1, 1]) == (1.0, 1.0, 1.0)
    d, lo, hi, p = paired_diff_ci([1, 1, 1, 1], [0, 0, 0, 0])
    assert (d, lo, hi) == (1.0, 1.0, 1.0) and p == pytest.approx(1 / 2000)
    d, _, _, p = paired_diff_ci([1, 0], [1, 0])
    assert d == 0 and p == 1.0
    rows = [{"item": i, "arm": a, "correct": c} for i, a, c in [
        ("x", "target", 1), ("y", "target", 1), ("z", "target", 0), ("w", "target", 1),
        ("x", "rho=0/rank", 1), ("y", "rho=0/rank", 0), ("z", "rho=0/rank", 0), ("w", "rho=0/rank", 1)]]
    rows += [{"item": i, "arm": "rho=0.3/rank", "correct": c, "position0": i == "x"}
             for i, c in [("x", 1), ("y", 1), ("z", 0), ("w", 0)]]
    s = {r["arm"]: r for r in summarise(rows, chance=0.25)}
    assert s["target"]["mean"] == 0.75 and s["rho=0/rank"]["mean"] == 0.5
    assert s["rho=0/rank"]["retention"] == pytest.approx(2 / 3) and s["rho=0/rank"]["diff"] == -0.25
    assert s["rho=0/rank"]["floor_retention"] == pytest.approx((0.5 - 0.25) / (0.75 - 0.25))
    assert s["rho=0.3/rank"]["gap_closed"] == pytest.approx(0.0) and s["rho=0.3/rank"]["position0"] == 0.25
    assert s["rho=0/rank"]["gap_closed"] == 0.0 and s["target"].get("gap_closed") is None
    rows += [{"item": i, "arm": "source", "correct": 1} for i in "xyzw"]
    assert "gap_closed" not in {r["arm"]: r for r in summarise(rows)}["source"]
    rows2 = [{"item": i, "arm": a, "bpb": v} for i, a, v in [
        ("x", "target", 1.0), ("y", "target", 1.2), ("x", "rho=0/rank", 2.0), ("y", "rho=0/rank", 2.2),
        ("x", "rho=0.3/rank", 1.5), ("y", "rho=0.3/rank", 1.7)]]
    s = {r["arm"]: r for r in summarise(rows2, "bpb", lower_is_better=True)}
    assert s["rho=0.3/rank"]["gap_closed"] == pytest.approx(0.5) and "retention" not in s["rho=0.3/rank"]


class ToyChoice(Toy):
    name = "toychoice"
    kind = "likelihood"

    def _all(self):
        return [dataclasses.replace(i, continuations=("the quick fox", "lazy dog jumps over", "add"), gold=i.extra["index"] % 3)
                for i in super()._all()]

    def score_likelihood(self, item, logprobs):
        from rarecache.eval.tasks.choice import OlmesChoice

        return OlmesChoice.score_likelihood(self, item, logprobs)


def test_choice_scoring_over_a_shared_cache_equals_separate_full_passes(models, tmp_path):
    import torch

    source, target, mapper = models
    task = ToyChoice()
    arms = [Arm.parse(a) for a in ("target", "source", "1:rank", "0.3:rank")]
    rows = load_results(run_task(task, task.items(), source, target, mapper, arms, tmp_path / "c.jsonl", progress=False))
    by = {(r["item"], r["arm"]): r for r in rows}
    for item in task.items():
        prompt = target.encode(list(item.messages))
        for arm, llm in (("target", target), ("source", source)):
            want = []
            for c in item.continuations:
                cont = target.tokenizer.encode(c, add_special_tokens=False)
                ids = prompt + cont
                logits = llm.runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None],
                                            llm.runner.new_cache(1, len(ids)), logits_at="all").logits[0]
                lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(cont)[:, None])
                want.append(lp.sum().item())
            assert by[(item.id, arm)]["logprobs"] == pytest.approx(want, abs=1e-3)
        assert by[(item.id, "rho=1/rank")]["logprobs"] == pytest.approx(by[(item.id, "target")]["logprobs"], abs=1e-3)
        r = by[(item.id, "rho=0.3/rank")]
        lps, chars = r["logprobs"], [len(c) for c in item.continuations]
        assert r["prediction"] == max(range(3), key=lambda j: lps[j])
        assert r["prediction_norm"] == max(range(3), key=lambda j: lps[j] / chars[j])
        assert r["correct_norm"] == (r["prediction_norm"] == item.gold)


def test_gsm8k_bpb_by_hand():
    import math

    from rarecache.eval.tasks.gsm8k import GSM8KBPB

    item = Item("x", (), "3", {}, ("ab€",))  # 5 bytes
    assert GSM8KBPB.score_likelihood(None, item, [-math.log(2) * 10]) == {"bpb": 2.0, "bytes": 5}
