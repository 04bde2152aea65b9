"""The one agreement rule (a tie is its own answer), ties and truncation in reports, map labels with their
sha256, on hand-made records."""

from __future__ import annotations

import json

import pytest

from rarecache.cli import main
from rarecache.eval.answers import agreement, answer, kappa, same_answer, ties, top_choices
from rarecache.eval.report import display, markdown, summarise
from rarecache.eval.tasks.base import Item, choice_scores
from rarecache.eval.tasks.mmlu import MMLU


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _mc(arm, item, logprobs, gold=0):
    return {"item": item, "arm": arm, "logprobs": logprobs, **MMLU().score_likelihood(
        Item(item, (), gold, continuations=("A", "B", "C", "D")), logprobs)}


def test_a_tie_is_an_answer_of_its_own():
    """Item a: the target ties A and B, the arm says A: they differ (the arm decided what the target could not).
    Item b: both tie A and B: they agree. Item c: the target says C, the arm ties C and D: they differ.
    Item d: both say D. Agreement 2 of 4, where counting a tie by its first choice would say 4 of 4."""
    rows = [_mc("target", "a", [-1.0, -1.0, -2.0, -3.0]), _mc("arm", "a", [-0.5, -1.0, -2.0, -3.0]),
            _mc("target", "b", [-1.5, -1.5, -2.0, -3.0]), _mc("arm", "b", [-1.25, -1.25, -2.0, -3.0]),
            _mc("target", "c", [-3.0, -3.0, -0.5, -2.0]), _mc("arm", "c", [-3.0, -3.0, -1.0, -1.0]),
            _mc("target", "d", [-3.0, -3.0, -2.0, -0.1]), _mc("arm", "d", [-3.0, -3.0, -2.0, -0.2])]
    by = {(r["item"], r["arm"]): r for r in rows}
    assert by["a", "target"]["top"] == [0, 1] and by["a", "target"]["tie"] and by["a", "target"]["prediction"] == 0
    assert by["a", "arm"]["top"] == [0] and not by["a", "arm"]["tie"]
    assert not same_answer(by["a", "target"], by["a", "arm"], "correct")
    assert same_answer(by["b", "target"], by["b", "arm"], "correct")
    assert agreement(rows, "arm", "correct") == (0.5, 4)
    first_choice = sum(by[i, "target"]["prediction"] == by[i, "arm"]["prediction"] for i in "abcd")
    assert first_choice == 4  # what the first-choice rule would have counted
    assert ties(rows, "target", "correct") == (2, 4) and ties(rows, "arm", "correct") == (2, 4)
    # κ: each answer (a tie's set too) one category; target {01, 01, 2, 3}, arm {0, 01, 23, 3}
    # p_o = 2/4; p_e = (2·1 [01] + 1·1 [3]) / 16 = 3/16; κ = (8/16 - 3/16) / (13/16) = 5/13
    assert kappa(rows, "arm", "correct") == pytest.approx(5 / 13)


def test_records_written_before_the_set_was_kept_read_the_same_rule():
    """An old MMLU row (logprobs, prediction, no `top`) has its set read from its logprobs; an old acc_norm row
    (no lengths recorded) keeps its one choice; a generated answer is a set of one."""
    old = {"item": "x", "arm": "target", "logprobs": [-1.0, -1.0, -2.0], "prediction": 0, "correct": True}
    assert answer(old, "correct") == (0, 1)
    assert answer({"prediction_norm": 2, "prediction": 0}, "correct_norm") == (2,)
    assert answer({"prediction": "42"}, "correct") == ("42",) and answer({"bpb": 1.0}, "bpb") is None
    assert top_choices([0.5, 0.25, 0.5]) == [0, 2]


def test_choice_scores_record_both_metrics_ties():
    """acc and acc_norm each record their set: equal log-probabilities over equal lengths tie in both; a longer
    choice with the same total wins acc's tie but not acc_norm's."""
    item = Item("q", (), 1, continuations=("ab", "cd", "efgh"))
    r = choice_scores(item, [-2.0, -2.0, -2.0])
    assert (r["top"], r["tie"], r["prediction"], r["correct"]) == ([0, 1, 2], True, 0, False)
    assert (r["top_norm"], r["tie_norm"], r["prediction_norm"]) == ([2], False, 2)
    r = choice_scores(item, [-3.0, -1.0, -4.0])
    assert (r["top"], r["tie"], r["correct"], r["top_norm"], r["tie_norm"]) == ([1], False, True, [1], False)


def test_report_counts_ties_truncations_and_names_maps_by_sha(tmp_path, capsys):
    """`eval report` prints the ties and the generations cut at the cap per arm, and each handoff arm with its
    map's sha256 prefix; a generation record written before `truncated` is read from its length at the
    recorded cap."""
    rows = [_mc("target", "a", [-1.0, -1.0, -2.0, -3.0]), _mc("rho=0.3/suffix@v4", "a", [-0.5, -1.0, -2.0, -3.0]),
            _mc("target", "b", [-1.0, -2.0, -2.0, -3.0]), _mc("rho=0.3/suffix@v4", "b", [-1.0, -1.0, -2.0, -3.0])]
    path = tmp_path / "mmlu.jsonl"
    path.write_text("".join(json.dumps({"task": "mmlu", **r}) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {"v4": {"file": "m", "sha256": "7145adb2" + "0" * 56}}}))
    assert main(["eval", "report", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    head = _cells(table[2])
    arm_row = _cells(next(line for line in table if line.startswith("| rho=0.3/suffix@v4[7145adb2] |")))
    assert arm_row[head.index("ties (top choices equal)")] == "1 of 2"
    assert arm_row[head.index("agreement with target (n)")] == "0% (n=2)"  # a: A vs {A, B}; b: {A, B} vs A
    gen = [{"task": "gsm8k", "item": i, "arm": a, "prediction": "1", "correct": True, "new_tokens": n}
           for i, a, n in (("x", "target", 1024), ("y", "target", 300), ("x", "source", 40), ("y", "source", 1024))]
    gen.append({"task": "gsm8k", "item": "z", "arm": "source", "prediction": "1", "correct": True, "new_tokens": 1024,
                "truncated": False})  # recorded: stopped by its answer at exactly the cap
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gen))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {}, "sampling": {"max_new_tokens": 1024}}))
    assert main(["eval", "report", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    col = _cells(table[2]).index("cut at the token cap")
    cells = {_cells(line)[0]: _cells(line)[col] for line in table[4:]}
    assert cells == {"target": "1 of 2", "source": "1 of 3"}
    assert "ties (top choices equal)" not in table[2]  # a generated answer has no ties to count


def test_display_names_a_map_by_its_sha256_prefix_and_keeps_old_labels_readable():
    shas = {"v4": "8907813a" + "1" * 56, "": "abcdef01" + "2" * 56}
    assert display("rho=0.3/suffix@v4", shas) == "rho=0.3/suffix@v4[8907813a]"
    assert display("rho=0.3/rank", shas) == "rho=0.3/rank[abcdef01]"  # the run's one unlabelled map
    assert display("rho=0.3/l2-oracle@v9", shas) == "rho=0.3/l2-oracle@v9[unrecorded] (oracle)"
    assert display("rho=0.3/suffix@v4") == "rho=0.3/suffix@v4" and display("target", shas) == "target"
    assert markdown(summarise([{"item": "x", "arm": "rho=0.3/suffix@v4", "correct": 1}]), shas=shas).splitlines()[2] \
        .startswith("| rho=0.3/suffix@v4[8907813a] | 1 |")


def test_report_prints_mcnemar_and_bits_per_byte_by_bytes(tmp_path, capsys):
    """Right/wrong: the arm right where the target is wrong on 0 items and the reverse on 5: McNemar p 2/32.
    Bits per byte: a 1-byte item 2.0 bpb above the target and a 99-byte item level with it: +1.0 by the mean
    of ratios, +0.02 by bytes."""
    rows = [{"item": f"i{k}", "arm": "target", "prediction": 0, "correct": True} for k in range(6)]
    rows += [{"item": f"i{k}", "arm": "source", "prediction": int(k < 5), "correct": k >= 5} for k in range(6)]
    s = {r["arm"]: r for r in summarise(rows)}
    assert (s["source"]["mcnemar_p"], s["source"]["mcnemar_gained"], s["source"]["mcnemar_lost"]) == (0.0625, 0, 5)
    assert "| 0.062 (+0 / −5) |" in markdown(list(s.values()))
    bpb = [{"item": "a", "arm": "target", "bpb": 1.0, "bytes": 1}, {"item": "b", "arm": "target", "bpb": 0.5, "bytes": 99},
           {"item": "a", "arm": "source", "bpb": 3.0, "bytes": 1}, {"item": "b", "arm": "source", "bpb": 0.5, "bytes": 99}]
    s = {r["arm"]: r for r in summarise(bpb, "bpb", lower_is_better=True)}
    assert s["source"]["diff"] == pytest.approx(1.0) and s["source"]["bytes_diff"] == pytest.approx(0.02)
    assert s["target"]["bytes_mean"] == pytest.approx((1.0 + 0.5 * 99) / 100) and "mcnemar_p" not in s["source"]
    table = markdown(list(s.values()), metric="bpb", percent=False)
    assert "| by bytes: total bits / total bytes |" in table and "| +0.0200 (" in table


def test_ties_are_counted_only_where_the_record_can_say():
    """A generated answer and an acc_norm row from before the set was kept cannot tie as far as the record
    shows: no count, rather than a count of zero."""
    old_norm = [{"item": "x", "arm": "a", "prediction": 0, "prediction_norm": 1, "correct_norm": 1}]
    assert ties(old_norm, "a", "correct_norm") is None
    assert ties([{"item": "x", "arm": "a", "prediction": "7", "correct": 1}], "a", "correct") is None
    new = [{"item": "x", "arm": "a", **choice_scores(Item("x", (), 0, continuations=("a", "b")), [-1.0, -1.0])}]
    assert ties(new, "a", "correct") == (1, 1) and ties(new, "a", "correct_norm") == (1, 1)
