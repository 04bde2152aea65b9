"""The quality gate: its ladder against direct handoffs and the target's own prefill, its policy
file, and the threshold fit on planted data."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rarecache.errors import RarecacheError
from rarecache.eval.gate_fit import fit_threshold
from rarecache.transfer.gate.policy import GatePolicy, decide, js_bits
from rarecache.transfer.gate.ladder import gated_handoff
from rarecache.transfer.handoff import HandoffConfig, budget, handoff

ALWAYS = math.inf  # accept the first rung
NEVER = -1.0  # fall back


def test_first_rung_is_a_direct_handoff(fitted):
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    for sel in ("rank", "attn-source"):
        pol = GatePolicy(sel, (0.2, 0.5), ALWAYS)
        cache, logits, res = gated_handoff(source, target, mapper, ids, pol)
        d_cache, d_logits, d_res = handoff(source, target, mapper, [ids], HandoffConfig(0.2, sel))
        assert res.decision == "accept" and res.rho == 0.2
        assert res.handoff.positions == d_res.positions
        torch.testing.assert_close(logits, d_logits, atol=1e-5, rtol=0)
        n = len(ids)
        torch.testing.assert_close(cache.k[:, :, :, :n], d_cache.k[:, :, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[:, :, :, :n], d_cache.v[:, :, :, :n], atol=1e-5, rtol=0)
        assert res.recomputed_share == budget(0.2, n) / n


def test_fallback_is_the_targets_own_prefill(fitted):
    """Past the top rung every handed-off row is rewritten: the cache and logits are the target's own,
    also when the target already held a prefix of the prompt."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    own, out = target.prefill([ids], max_len=n)
    for kept in (0, 9):
        # a margin floor no rung meets: the whole ladder climbed, then the fallback
        climbs = GatePolicy("rank", (0.1, 0.3), ALWAYS, min_margin=math.inf)
        # a policy that can accept nothing decides before the handoff: no map, no source prefill, no rung
        never = GatePolicy("rank", (0.1, 0.3), NEVER)
        early = GatePolicy("rank", (0.1, 0.3), ALWAYS, max_rungs=0)
        for policy, rungs in ((climbs, [0.0, 0.1, 0.3]), (never, []), (early, [])):
            assert policy.always_falls_back == (not rungs)
            held = target.new_cache(1, n)
            if kept:
                held.copy_prefix(own, kept)
            src = source.new_cache(1, n)
            cache, logits, res = gated_handoff(source, target, mapper, ids, policy, source_cache=src,
                                               target_cache=held, target_kept=kept)
            assert res.decision == "fallback" and res.recomputed_share == 1.0 and res.rho == 1.0
            assert [r.rho for r in res.rungs] == rungs
            assert res.handoff.positions == [list(range(kept, n))] and res.handoff.handed_off == [(kept, n)]
            assert bool(src.k.abs().sum()) == bool(rungs)  # the source prefilled only when rungs were climbed
            assert res.source_prefilled == bool(rungs) and res.record()["source_prefilled"] == bool(rungs)
            assert ("map" in res.handoff.timings) == bool(rungs) and res.handoff.timings["fallback_prefill"] > 0
            torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.k[:, :, :, :n], own.k[:, :, :, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.v[:, :, :, :n], own.v[:, :, :, :n], atol=1e-5, rtol=0)


def test_recorded_ladder_equals_the_online_gate(fitted):
    """What an evaluation records (every rung climbed, each snapshotted) is what the online gate
    returns at the rung its threshold accepts: the simulated policy is the served one."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    rungs = (0.1, 0.2, 0.3, 0.5)
    snaps = target.new_cache(len(rungs), n)
    _, per_rung, rec = gated_handoff(source, target, mapper, ids, GatePolicy("rank", rungs, NEVER),
                                     climb_all=True, snapshots=snaps)
    js = [r.js for r in rec.rungs[1:]]
    assert per_rung.shape[0] == len(rungs) and all(d >= 0 for d in js)
    assert [r.recomputed for r in rec.rungs[1:]] == [budget(r, n) for r in rungs]  # nested budgets
    for th in sorted(set(js)):
        k = decide(js, th)
        cache, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy("rank", rungs, th))
        assert res.decision == "accept" and res.rho == rungs[k]
        torch.testing.assert_close(logits[0], per_rung[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.k[:, 0, :, :n], snaps.k[:, k, :, :n], atol=1e-5, rtol=0)
        assert res.recomputed_share == budget(rungs[k], n) / n
    # climbing at most m rungs: the rung the record says, else a fallback after exactly m rungs
    th = sorted(js)[len(js) // 2]
    for m in range(len(rungs) + 1):
        k = decide(js, th, max_rungs=m)
        cache, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy("rank", rungs, th, max_rungs=m))
        if k is None:
            assert res.decision == "fallback" and len(res.rungs) == (1 + m if m else 0)  # 0: decided at once
        else:
            assert res.decision == "accept" and res.rho == rungs[k] and k < m
            torch.testing.assert_close(logits[0], per_rung[k], atol=1e-5, rtol=0)


def test_js_bits():
    a = torch.tensor([2.0, 0.0, -1.0])
    assert js_bits(a, a) == pytest.approx(0.0, abs=1e-12)
    # two disjoint point masses: one bit
    assert js_bits(torch.tensor([50.0, -50.0]), torch.tensor([-50.0, 50.0])) == pytest.approx(1.0, abs=1e-9)
    assert js_bits(a, -a) == pytest.approx(js_bits(-a, a))


def test_fit_recovers_the_planted_threshold():
    """Items whose js at a rung is below 0.05 keep the answer there, above it they lose it: the fit
    must find the largest threshold that keeps the loss at zero, i.e. the largest safe js."""
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(200):
        js = (torch.rand(3, generator=g) * 0.1).tolist()
        items.append((js, [0.0 if d < 0.05 else 1.0 for d in js], [0.1, 0.2, 0.3]))
    th, floor, out, _, _ = fit_threshold({"t": items}, {"t": 0.0})
    assert floor is None
    safe = max(d for js, _, _ in items for d in js if d < 0.05)
    assert th == safe and out["t"]["loss"] == 0.0
    # a looser bound accepts more, at a lower cost
    th2, _, out2, _, _ = fit_threshold({"t": items}, {"t": 0.05})
    assert th2 > th and out2["t"]["cost"] < out["t"]["cost"] and out2["t"]["loss"] <= 0.05
    # every group must hold its bound: a second group that loses everything forces fallback
    bad = [([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.1, 0.2, 0.3])] * 10
    th3, _, out3, _, _ = fit_threshold({"t": items, "bad": bad}, {"t": 0.05, "bad": 0.0})
    assert th3 < 0 and out3["bad"]["fallback"] == 1.0 and out3["t"]["cost"] == 1.0


def _planted_ladders(metric: str, target: list[float], value: list[list[float]], changed: list[list[bool]],
                     prompt: int = 100) -> "Ladders":
    from rarecache.eval.gate_report import Ladders

    rungs = [0.1, 0.2, 0.3, 0.5]
    n = len(target)
    return Ladders("t", metric, "changed", "ladder/suffix@m", "suffix", rungs, [f"i{k}" for k in range(n)], None,
                   js=[[0.0] * 4] * n, margin=None, loss=[[float(c) for c in ch] for ch in changed],
                   cost=[[(r * prompt + 1) / prompt for r in rungs]] * n, value=value, target=target,
                   changed=changed, seconds=[{}] * n)


def test_oracle_is_the_cheapest_choice_that_keeps_every_answer():
    """Brute force over every per-item choice (a rung up to the cap, or fallback at cost 1): among those that
    change no answer, none costs less than the oracle's, and the oracle's changes none."""
    import itertools

    from rarecache.eval.gate_report import oracle

    g = torch.Generator().manual_seed(1)
    n = 7
    changed = (torch.rand(n - 1, 4, generator=g) < 0.5).tolist() + [[True, True, False, False]]  # kept only above 0.2
    target = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    value = [[t if not c else 1.0 - t for c in ch] for t, ch in zip(target, changed)]  # a change flips right/wrong
    lad = _planted_ladders("correct", target, value, changed)
    for cap in (0.2, 0.5):
        o = oracle(lad, cap)
        allowed = [r for r, rho in enumerate(lad.rungs) if rho <= cap]
        best = min(sum(1.0 if r is None else lad.cost[k][r] for k, r in enumerate(choice))
                   for choice in itertools.product(allowed + [None], repeat=n)
                   if all(r is None or not changed[k][r] for k, r in enumerate(choice)))
        assert o["mean_recomputed_share"] == pytest.approx(best / n)
        assert o["delta"] == 0.0
        keeps = sum(any(not changed[k][r] for r in allowed) for k in range(n))
        assert o["fallback_share"] == pytest.approx(1 - keeps / n) and sum(o["accepted"].values()) == keeps
    assert oracle(lad, 0.2)["fallback_share"] > oracle(lad, 0.5)["fallback_share"]  # the last item: only under 0.5
    # the accuracy oracle may take a change that costs nothing: wrong to another wrong answer, or an improvement
    lad = _planted_ladders("correct", [0.0, 1.0, 0.0], [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0],
                                                         [1.0, 1.0, 1.0, 1.0]],
                           [[True, True, True, True], [True, True, True, False], [True, True, True, True]])
    assert oracle(lad, 0.5)["fallback_share"] == pytest.approx(2 / 3)
    acc = oracle(lad, 0.5, "accuracy")
    assert acc["fallback_share"] == 0.0 and acc["accepted"] == {0.1: 2, 0.2: 0, 0.3: 0, 0.5: 1}
    assert acc["delta"] == pytest.approx(100 / 3)  # the improvement on the third item, in pp
    # bits per byte: "no worse" is at most CHANGED_BPB above the target; lower is better
    lad = _planted_ladders("bpb", [0.50, 0.50], [[0.60, 0.45, 0.45, 0.45], [0.60, 0.60, 0.505, 0.50]],
                           [[True, True, True, True], [True, True, False, False]])
    o = oracle(lad, 0.5, "accuracy")
    assert o["accepted"] == {0.1: 0, 0.2: 1, 0.3: 1, 0.5: 0} and o["delta"] == pytest.approx((-0.05 + 0.005) / 2)
    o = oracle(lad, 0.5)  # "changed": an improvement past CHANGED_BPB is a change too
    assert o["accepted"] == {0.1: 0, 0.2: 0, 0.3: 1, 0.5: 0} and o["fallback_share"] == 0.5
    with pytest.raises(RarecacheError, match="unknown gate loss"):
        oracle(lad, 0.5, "bpb")


def test_fit_falls_back_early_when_climbing_is_wasted():
    """Planted: half the items keep their answer from rung 1 on (tiny js), the other half lose it at
    every rung whatever the signal says. Climbing all three rungs before falling back on those wastes
    0.3 of a prefill each; the fit must stop after rung 1 and still lose nothing."""
    good = [([1e-4, 1e-4, 1e-4], [0.0, 0.0, 0.0], [0.1, 0.2, 0.3])] * 50
    hopeless = [([0.5, 2e-4, 1e-4], [1.0, 1.0, 1.0], [0.1, 0.2, 0.3])] * 50
    th, floor, out, most, _ = fit_threshold({"t": good + hopeless}, {"t": 0.0})
    assert most == 1 and 1e-4 <= th < 0.5 and out["t"]["loss"] == 0.0
    assert out["t"]["fallback"] == 0.5 and out["t"]["work"] == pytest.approx(0.5 * 0.1 + 0.5 * 1.1)
    assert out["t"]["cost"] == pytest.approx(0.5 * 0.1 + 0.5 * 1.0)  # the figure: a fallback is 1.0
    # nothing safe anywhere: fall back right after plain transfer, not after the ladder
    th, _, out, most, _ = fit_threshold({"t": hopeless}, {"t": 0.0})
    assert most == 0 and th < 0 and out["t"]["work"] == 1.0


def test_fit_uses_a_margin_floor_when_the_signal_alone_cannot_separate():
    """Planted: js says nothing (always tiny); a rung's answer is kept exactly when its top-2 margin
    is above 1 nat. js alone can only fall back everywhere; with the margin floor the fit accepts the
    confident rungs and loses nothing."""
    g = torch.Generator().manual_seed(1)
    items = []
    for _ in range(200):
        m = (torch.rand(3, generator=g) * 2).tolist()
        items.append(([1e-4] * 3, [0.0 if x > 1.0 else 1.0 for x in m], [0.1, 0.2, 0.3], m))
    th, floor, out, _, _ = fit_threshold({"t": items}, {"t": 0.0}, margins=False)
    assert th < 0 and out["t"]["cost"] == 1.0
    th, floor, out, _, _ = fit_threshold({"t": items}, {"t": 0.0}, margins=True)
    assert floor is not None and floor >= 1.0 and out["t"]["loss"] == 0.0 and out["t"]["cost"] < 0.6
    # the online decision agrees with the fitted rule
    for js, ls, cs, m in items:
        k = decide(js, th, m, floor)
        assert k is None or m[k] >= floor


def test_policy_file_round_trip_and_validation(tmp_path):
    pol = GatePolicy("attn-source", (0.1, 0.3), 0.02, fitted={"items": 5})
    f = tmp_path / "p.json"
    f.write_text(pol.to_json())
    back = GatePolicy.load(f)
    assert back == pol and back.fitted == {"items": 5} and back.max_rungs is None
    early = GatePolicy("rank", (0.1, 0.3), 0.02, max_rungs=1)
    f.write_text(early.to_json())
    assert GatePolicy.load(f) == early and GatePolicy.load(f).max_rungs == 1
    for m in (3, -1, 1.5, True, "1"):
        with pytest.raises(RarecacheError, match="max_rungs"):
            GatePolicy("rank", (0.1, 0.3), 0.02, max_rungs=m)
    bad = [("not json", "not a readable"), ("[]", "not a gate policy"),
           (json.dumps({"format": "rarecache-gate-policy/1", "selector": "rank", "rungs": [0.3, 0.1],
                        "threshold": 0.1}), "increase strictly"),
           (json.dumps({"format": "rarecache-gate-policy/1", "selector": "nope", "rungs": [0.1],
                        "threshold": 0.1}), "unknown selector"),
           (json.dumps({"format": "rarecache-gate-policy/1", "selector": "rank", "rungs": [0.1],
                        "threshold": "x"}), "must be a number"),
           (json.dumps({"format": "rarecache-gate-policy/1", "selector": "rank", "rungs": [0.1],
                        "threshold": 0.1, "code": "import os"}), "unknown gate policy field"),
           ('{"format": "rarecache-gate-policy/1", "selector": "rank", "rungs": [0.1], "threshold": 1' + "0" * 400
            + "}", "too large"),
           ('{"format": "rarecache-gate-policy/1", "selector": "rank", "rungs": [1' + "0" * 400 + '], "threshold": 1}',
            "too large")]
    for text, msg in bad:
        f.write_text(text)
        with pytest.raises(RarecacheError, match=msg):
            GatePolicy.load(f)


# -- the ladder arm of an evaluation, and the fit/report commands on it ------------------------

def _ladder_run(models, tmp_path, items, name, sel="rank"):
    from rarecache.eval.arms import parse_arms
    from rarecache.eval.run import run_task

    from .test_eval import ToyChoice

    source, target, mapper = models
    task = ToyChoice()
    arms = parse_arms(["target", f"0.1:{sel}", f"0.5:{sel}", f"ladder:{sel}"], ("",))
    return run_task(task, task.items()[items], source, target, mapper, arms, tmp_path / name, progress=False)


@pytest.fixture()
def models(pair_dir, fitted):
    from rarecache import LLM

    return LLM(pair_dir / "src"), LLM(pair_dir / "tgt"), fitted[2]


@pytest.mark.parametrize("sel", ["rank", "suffix+attn"])
def test_ladder_arm_records_every_rung_and_its_first_equals_the_direct_arm(models, tmp_path, sel):
    from rarecache.eval.results import load_results

    rows = load_results(_ladder_run(models, tmp_path, slice(0, 3), "a.jsonl", sel))
    by = {(r["item"], r["arm"]): r for r in rows}
    for item in {r["item"] for r in rows}:
        lad = by[(item, f"ladder/{sel}")]["ladder"]
        assert [g["rho"] for g in lad] == [0.1, 0.2, 0.3, 0.5]
        assert lad[0]["logprobs"] == pytest.approx(by[(item, f"rho=0.1/{sel}")]["logprobs"], abs=1e-4)
        n = by[(item, "target")]["prompt_tokens"]
        assert [g["recomputed"] for g in lad] == [budget(r, n) for r in (0.1, 0.2, 0.3, 0.5)]
        assert "correct" not in by[(item, f"ladder/{sel}")]  # no headline metric: summaries skip it
    # the candidate signal js_source, the long way for rung 1: a direct handoff at 0.1 against the source alone
    from .test_eval import ToyChoice

    source, target, mapper = models
    for item in ToyChoice().items()[0:3]:
        ids = source.encode(item.prompt)
        _, own = source.runner.prefill([ids])
        _, logits, _ = handoff(source.runner, target.runner, mapper, [ids], HandoffConfig.named(0.1, sel))
        got = by[(item.id, f"ladder/{sel}")]["ladder"][0]["js_source"]
        assert got == pytest.approx(js_bits(logits[0], own.logits[0]), rel=1e-3, abs=1e-6) and got > 0


def test_gate_fit_and_report_on_held_apart_items(models, tmp_path, capsys):
    from rarecache.cli import main
    from rarecache.eval.gate_report import evaluate, read_ladders
    from rarecache.eval.results import load_results

    held = _ladder_run(models, tmp_path, slice(0, 3), "held.jsonl")
    ev = _ladder_run(models, tmp_path, slice(3, 5), "ev.jsonl")
    pol = tmp_path / "policy.json"
    capsys.readouterr()
    assert main(["eval", "gate", "fit", str(held), "--max-changed", "0.5", "--out", str(pol)]) == 0
    policy = GatePolicy.load(pol)
    printed = capsys.readouterr().out  # every signal's AUC pooled and within each rung, each with its interval
    line = next(x for x in printed.splitlines() if x.startswith("  nll: "))
    for rho in ("0.1", "0.2", "0.3", "0.5"):
        c = policy.fitted["signals"]["rungs"][rho]["nll"]
        want = "-" if c["auc"] is None else f"{c['auc']:.3f} ({c['ci'][0]:.3f}-{c['ci'][1]:.3f})"
        assert f"{rho}: {want}" in line, (rho, line)
    assert "changed answers: rho 0.1: " in printed
    assert policy.fitted["tasks"]["toychoice"]["items"] == ["toy-0", "toy-1", "toy-2"]
    # the same fit at other bounds, stored: a looser bound never costs more; the file's own level is the policy
    levels = policy.fitted["levels"]
    assert [lv["max_changed"] for lv in levels] == [0.0, 0.25, 0.5, 1.0, 2.5, 5.0]
    costs = [lv["tasks"]["toychoice"]["cost"] for lv in levels]
    assert costs == sorted(costs, reverse=True) and levels[0]["tasks"]["toychoice"]["loss"] == 0
    assert all(lv["tasks"]["toychoice"]["loss"] <= lv["max_changed"] + 1e-12 for lv in levels)
    assert (levels[2]["threshold"], levels[2]["min_margin"]) == (policy.threshold, policy.min_margin)
    tighter = policy.at_loss(0.3)  # the largest stored level at most 0.3: 0.25
    assert tighter.threshold == levels[1]["threshold"] and tighter.fitted["bounds"]["max_changed"] == 0.25
    assert policy.at_loss(0.5).threshold == policy.threshold
    with pytest.raises(RarecacheError, match="no fitted level allows at most -0.1"):
        policy.at_loss(-0.1)
    with pytest.raises(RarecacheError, match="stores no other loss levels"):
        GatePolicy("rank").at_loss(0.01)
    # levels tied in share of answers go to the looser bpb bound; malformed levels are refused, not served
    tie = GatePolicy("rank", fitted={"levels": [{"max_changed": 0, "max_bpb": 0, "threshold": -1.0},
                                                {"max_changed": 0, "max_bpb": 0.01, "threshold": 0.2}]})
    assert tie.at_loss(0.5).threshold == 0.2
    for bad in (float("nan"), float("inf"), 10 ** 400, True, "0.1"):
        odd = GatePolicy("rank", fitted={"levels": [{"max_changed": bad, "max_bpb": 0, "threshold": 0.1}]})
        with pytest.raises(RarecacheError, match="malformed"):
            odd.at_loss(0.5)
    # a policy is read on ladders of the map it was fitted through only
    other = GatePolicy(policy.selector, policy.rungs, policy.threshold, policy.min_margin,
                       {**policy.fitted, "tasks": {"toychoice": {"items": [], "map_sha256": "f" * 64}}})
    with pytest.raises(RarecacheError, match="fitted through another map"):
        evaluate(read_ladders(ev), other)
    # evaluating on the items it was fitted on is refused
    assert main(["eval", "gate", "report", str(held), "--policy", str(pol)]) == 2
    summary = tmp_path / "gate-summary.json"
    assert main(["eval", "gate", "report", str(ev), "--policy", str(pol), "--summary", str(summary)]) == 0
    fitted_task = policy.fitted["tasks"]["toychoice"]
    lo, hi = fitted_task["auc_ci"]
    a = fitted_task["auc"]  # (nan where the toy items all changed, or none did)
    assert (lo <= a <= hi) or all(map(math.isnan, (a, lo, hi)))
    assert json.dumps(policy.fitted["auc_pooled"]) == json.dumps({"auc": a, "ci": [lo, hi]})  # one task: the same
    whole = json.loads(summary.read_text())
    got = whole["tasks"]["toychoice"]
    assert got["n"] == 2 and got["unit"] == "pp" and 0 <= got["fallback_share"] <= 1
    # the schema: as before, plus agreement and every recorded signal's AUC with its interval (pooled, per rung)
    assert set(whole) == {"map", "policy", "tasks", "held_auc", "held_signals"}
    assert set(got) == {"unit", "delta", "ci", "n", "fallback_share", "mean_recomputed_share", "expected_speedup",
                        "auc", "auc_ci", "agreement", "signals"}
    assert 0 <= got["agreement"] <= 1 and set(got["signals"]["rungs"]) == {"0.1", "0.2", "0.3", "0.5"}
    assert {"js", "js_plain", "js_source", "margin", "nll", "nll_shift", "nll_gap", "probe_cos", "row_error",
            "combined"} <= set(got["signals"]["pooled"]) == set(whole["held_signals"]["pooled"])
    for cell in [*got["signals"]["pooled"].values(), *whole["held_signals"]["rungs"]["0.2"].values()]:
        assert set(cell) == {"auc", "ci", "n", "changed"} and len(cell["ci"]) == 2
        assert cell["auc"] is None or (0 <= cell["auc"] <= 1 and (cell["ci"][0] is None
                                                                   or cell["ci"][0] <= cell["auc"] <= cell["ci"][1]))
    # the two ends by hand: never accept = the target's answers at cost 1; always accept = rung 1's
    lad = read_ladders(ev)
    rows = {(r["item"], r["arm"]): r for r in load_results(ev)}
    never = evaluate(lad, GatePolicy("rank", (0.1, 0.2, 0.3, 0.5), -1.0))
    assert never["delta"] == 0 and never["fallback_share"] == 1 and never["mean_recomputed_share"] == 1
    always = evaluate(lad, GatePolicy("rank", (0.1, 0.2, 0.3, 0.5), math.inf))
    want = [float(rows[(i, "rho=0.1/rank")]["correct"]) - float(rows[(i, "target")]["correct"]) for i in lad.items]
    assert always["delta"] == pytest.approx(100 * sum(want) / len(want))
    assert always["fallback_share"] == 0 and never["agreement"] == 1
    same = [rows[(i, "ladder/rank")]["ladder"][0]["prediction"] == rows[(i, "target")]["prediction"] for i in lad.items]
    assert always["agreement"] == sum(same) / len(same)
    assert always["mean_recomputed_share"] == pytest.approx(
        sum(budget(0.1, rows[(i, "target")]["prompt_tokens"]) / rows[(i, "target")]["prompt_tokens"]
            for i in lad.items) / 2)
    assert always["expected_speedup"] > 0
    # --loss accuracy: a rung's loss is the accuracy lost against the target (changes between wrong answers free)
    acc = read_ladders(ev, loss="accuracy")
    for i, item in enumerate(acc.items):
        t = float(rows[(item, "target")]["correct"])
        assert acc.loss[i] == [t - float(g["correct"]) for g in rows[(item, "ladder/rank")]["ladder"]]
        assert lad.loss[i] == [float(c) for c in lad.changed[i]]
    pol_acc = tmp_path / "policy-acc.json"
    assert main(["eval", "gate", "fit", str(held), "--loss", "accuracy", "--max-changed", "0", "--out",
                 str(pol_acc)]) == 0
    fitted = GatePolicy.load(pol_acc).fitted
    assert fitted["loss"] == "accuracy" and policy.fitted["loss"] == "changed"
    assert all(lv["tasks"]["toychoice"]["loss"] <= lv["max_changed"] + 1e-12 for lv in fitted["levels"])
    with pytest.raises(RarecacheError, match="unknown gate loss"):
        read_ladders(ev, loss="bits")


def test_auc_by_hand():
    from rarecache.eval.gate_report import auc

    assert auc([0.1, 0.2, 0.9, 0.8], [False, False, True, True]) == 1.0
    assert auc([0.9, 0.8, 0.1, 0.2], [False, False, True, True]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5
    assert math.isnan(auc([0.1, 0.2], [True, True]))


def test_pooled_auc_resamples_within_each_task():
    """A pooled AUC is the AUC of every task's pairs together; its bootstrap keeps each task's item
    count, so no draw is one task alone (whose signal may run the other way)."""
    from rarecache.eval.gate_report import auc, auc_ci

    a = [([0.5], [True]), ([0.6], [False])]  # task 0: the signal inverted within it
    b = [([0.9], [True]), ([0.1], [False]), ([0.95], [True]), ([0.05], [False])]  # task 1: it separates
    items = a + b
    point, lo, hi = auc_ci(items, n_boot=300, strata=[0, 0, 1, 1, 1, 1])
    assert point == auc([0.5, 0.6, 0.9, 0.1, 0.95, 0.05], [True, False, True, False, True, False]) == 8 / 9
    # a stratified draw holds 2 items of task 0 and 4 of task 1: at worst both task-0 items are its negative
    # (0.6, above task 1's negatives only) or its positive (0.5, below task 1's positives only)
    assert 0.75 <= lo <= point <= hi == 1.0
    _, lo_all, _ = auc_ci(items, n_boot=300)  # ignoring the tasks a draw can be task 0's pair alone: AUC 0
    assert lo_all < lo


# -- the gate where users meet it: Conversation and the server ------------------------------

def test_a_gated_conversation_that_falls_back_equals_the_target_alone(chat):
    """A policy that never accepts: every switched turn is the model's own prefill (exactly), and the
    turn says the gate fell back; one that always accepts runs the first rung."""
    from rarecache import SamplingConfig
    from rarecache.transfer.conversation import Conversation

    models, maps = chat
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    conv = Conversation(models, maps, sampling=sampling, gate=GatePolicy("rank", (0.1, 0.3), NEVER))
    for text, who in zip(["the quick brown fox", "jumps over the lazy dog", "def add return"],
                         ["small", "large", "small"]):
        want = models[who].generate([conv.messages + [{"role": "user", "content": text}]], sampling)[0].tokens
        before = {name: list(st.ids) for name, st in conv.state.items()}
        turn = conv.say(text, who)
        assert turn.tokens == want
        if len(conv.turns) > 1:
            assert turn.gate.decision == "fallback" and turn.gate.recomputed_share == 1.0
            assert turn.gate.rungs == [] and not conv.state[who].approximate
            other = next(name for name in conv.state if name != who)  # decided at once: it prefilled nothing
            assert conv.state[other].ids == before[other]
    conv = Conversation(models, maps, sampling=sampling, gate=GatePolicy("rank", (0.3, 0.5), ALWAYS))
    conv.say("the quick brown fox", "small")
    turn = conv.say("jumps over the lazy dog", "large")
    assert turn.gate.decision == "accept" and turn.gate.rho == 0.3
    assert len(turn.handoff.positions[0]) == budget(0.3, turn.prompt_tokens)


def test_the_response_says_what_the_gate_decided(chat):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rarecache import SamplingConfig
    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    for policy, decision in ((GatePolicy("rank", (0.1, 0.3), NEVER), "fallback"),
                             (GatePolicy("rank", (0.2, 0.5), ALWAYS), "accept")):
        cfg = ServiceConfig(gate=policy, min_handoff_tokens=0)
        client = TestClient(create_app(ChatService(models, maps, cfg)))
        messages = [{"role": "user", "content": "the quick brown fox"}]
        first = client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 4})
        assert first.json()["rarecache"]["gate_summary"] == (  # every response says what the gate did
            "the gate did not run: no other model's rows were handed off (the model read the prompt itself)")
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "jumps over the lazy dog"}]
        r = client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        info = r.json()["rarecache"]
        assert info["handed_off_from"] == "small" and info["gate"]["decision"] == decision
        assert info["gate"]["reason"] and info["rho"] == (1.0 if decision == "fallback" else 0.2)
        reason = info["gate"]["reason"]
        said = (f"fell back to the target's own prefill: {reason}" if decision == "fallback"
                else f"accepted at rho 0.2: {reason}")
        assert info["gate_summary"] == info["gate"]["summary"] == said
        assert decision == "fallback" or reason.startswith("js ") and "against plain transfer" in reason
        n = r.json()["usage"]["prompt_tokens"]
        if decision == "fallback":  # the model's own prefill: the same answer as the model alone
            want = models["large"].generate([messages], SamplingConfig(max_new_tokens=4))[0].text
            assert r.json()["choices"][0]["message"]["content"] == want
            assert info["recomputed_tokens"] == info["handed_off_tokens"] == n - info["reused_tokens"]
        else:
            assert info["recomputed_tokens"] == budget(0.2, info["handed_off_tokens"])


def test_a_request_on_a_gated_server_may_name_a_fixed_budget(chat):
    """On a server started with --rho auto, a request's own ρ replaces the gate for that request (no
    gate record, a line saying it did not run, the ρ it named); "auto" keeps the gate, whose selector a request
    cannot change."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    cfg = ServiceConfig(gate=GatePolicy("rank", (0.1, 0.3), NEVER), min_handoff_tokens=0)
    client = TestClient(create_app(ChatService(models, maps, cfg)))

    def switched(salt, **extra):
        messages = [{"role": "user", "content": "the quick brown fox"}]
        first = client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 4,
                                                          "cache_salt": salt})
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "jumps over the lazy dog"}]
        return client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 4,
                                                         "cache_salt": salt, **extra})

    fixed = switched("a", rarecache={"rho": 0.2, "selector": "suffix"}).json()["rarecache"]
    assert "gate" not in fixed and (fixed["rho"], fixed["selector"]) == (0.2, "suffix")
    assert fixed["gate_summary"] == "the gate did not run: the request named a fixed budget"
    assert fixed["recomputed_tokens"] == budget(0.2, fixed["handed_off_tokens"])
    gated = switched("b", rarecache={"rho": "auto"}).json()["rarecache"]
    assert gated["gate"]["decision"] == "fallback" and (gated["rho"], gated["selector"]) == (1.0, "rank")
    after = switched("d").json()["rarecache"]  # after a request with its own budget, the server's again
    assert after["gate"]["decision"] == "fallback" and after["rho"] == 1.0
    for options, why in (({"rho": "auto", "selector": "suffix"}, "the gate policy's selector"),
                         ({"selector": "suffix"}, "must name its rho too")):
        r = switched("c", rarecache=options)
        assert r.status_code == 400 and why in r.json()["error"]["message"]


def test_serve_rho_auto_needs_a_policy_fitted_through_the_served_map(pair_dir, fitted, tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi")
    import uvicorn
    from fastapi.testclient import TestClient

    from rarecache.cli import main
    from rarecache.packages import sha256_file

    _, _, mapper, _ = fitted
    path = tmp_path / "m.safetensors"
    mapper.save(path)
    args = ["serve", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--map", str(path)]
    policy = tmp_path / "p.json"
    policy.write_text(GatePolicy("rank", (0.1, 0.3), NEVER, fitted={"tasks": {"t": {"map_sha256": "0" * 64}}}).to_json())
    for extra, msg in ((["--rho", "auto"], "needs --gate-policy"), (["--rho", "half"], "a number in [0, 1] or auto"),
                       (["--gate-policy", str(policy)], "go with --rho auto"),
                       (["--rho", "auto", "--gate-policy", str(policy)], "was not fitted through"),
                       (["--rho", "auto", "--gate-policy", str(policy), "--engine", "vllm"], "was not fitted")):
        assert main([*args, *extra]) == 2
        assert msg in capsys.readouterr().err
    # a ladder on js: the vLLM path serves nll at one rung with suffix only (adapters/vllm/server/vllm_gate.py)
    policy.write_text(GatePolicy("rank", (0.1, 0.3), 0.5, fitted={"tasks": {"t": {"map_sha256": sha256_file(path)}}}).to_json())
    assert main([*args, "--rho", "auto", "--gate-policy", str(policy), "--engine", "vllm"]) == 2
    assert "--engine vllm serves a gate policy only as a policy on nll" in capsys.readouterr().err
    policy.write_text(GatePolicy("rank", (0.1, 0.3), NEVER, fitted={"tasks": {"t": {"map_sha256": sha256_file(path)}}}).to_json())
    assert main([*args, "--heal", "--engine", "vllm"]) == 2
    assert "--heal runs in our own engine only" in capsys.readouterr().err
    assert main([*args, "--max-loss", "0.01"]) == 2
    assert "go with --rho auto" in capsys.readouterr().err
    assert main([*args, "--rho", "auto", "--gate-policy", str(policy), "--max-loss", "0.01"]) == 2
    assert "stores no other loss levels" in capsys.readouterr().err
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    sha = sha256_file(path)
    levels = [{"max_changed": 0.0, "max_bpb": 0.0, "threshold": -1.0, "min_margin": None, "tasks": {}},
              {"max_changed": 0.05, "max_bpb": 0.0125, "threshold": 0.02, "min_margin": None, "tasks": {}}]
    leveled = tmp_path / "levels.json"
    leveled.write_text(GatePolicy("rank", (0.1, 0.3), NEVER, fitted={"tasks": {"t": {"map_sha256": sha}},
                                                                     "levels": levels}).to_json())
    assert main([*args, "--rho", "auto", "--gate-policy", str(leveled), "--max-loss", "0.1"]) == 0
    assert "the level fitted at <= 0.05 changed answers, <= 0.0125 bpb (threshold 0.02 bits)" in capsys.readouterr().err
    assert main([*args, "--rho", "auto", "--gate-policy", str(leveled), "--max-loss", "2"]) == 2
    assert "--max-loss is a share of answers in [0, 1]" in capsys.readouterr().err
    assert main([*args, "--rho", "auto", "--gate-policy", str(policy), "--min-handoff-tokens", "0"]) == 0
    assert "gate rank, rungs 0.1/0.3" in capsys.readouterr().err
    client = TestClient(started["app"])
    messages = [{"role": "user", "content": "the quick brown fox"}]
    client.post("/v1/chat/completions", json={"model": "src", "messages": messages, "max_tokens": 3})
    r = client.post("/v1/chat/completions", json={"model": "tgt", "messages": messages, "max_tokens": 3})
    assert r.json()["rarecache"]["gate"]["decision"] == "fallback"


def test_reused_mapped_rows_are_labelled_in_later_responses(chat):
    """A handoff leaves mapped rows in the receiving model's cache, and every row computed after them
    attended to them; a later request that reuses them says how many it reused (never passed off as the
    model's own rows): here every reused row, the handoff having started at position 0. All recomputed
    (ρ = 1) or a gate fallback leaves none."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    short = {"min_handoff_tokens": 0}  # the tiny models' prompts are short: hand them off all the same
    for cfg, approximate in ((ServiceConfig(HandoffConfig(0.3, "rank"), **short), True),
                             (ServiceConfig(HandoffConfig(1.0), **short), False),
                             (ServiceConfig(gate=GatePolicy("rank", (0.1, 0.3), NEVER), **short), False)):
        client = TestClient(create_app(ChatService(models, maps, cfg)))
        messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
        client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 3})
        r = client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 3})
        first = r.json()["rarecache"]
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "def add return"}]
        again = client.post("/v1/chat/completions", json={"model": "large", "messages": messages,
                                                          "max_tokens": 3}).json()["rarecache"]
        assert again["handed_off_from"] is None and again["reused_tokens"] > 0
        mapped = first["handed_off_tokens"] - first["recomputed_tokens"]
        assert again["reused_approximate_tokens"] == (again["reused_tokens"] if approximate else 0)
        # a branch of the same conversation (another second question) copies the shared rows: still labelled
        branch = messages[:-1] + [{"role": "user", "content": "tokens and spaces"}]
        other = client.post("/v1/chat/completions", json={"model": "large", "messages": branch,
                                                          "max_tokens": 3}).json()["rarecache"]
        assert other["handed_off_from"] is None and 0 < other["reused_tokens"]
        assert other["reused_approximate_tokens"] == (other["reused_tokens"] if approximate else 0)
        assert (mapped > 0) == approximate


def test_an_idle_healing_server_serves_later_turns_from_the_models_own_rows(chat):
    """`serve --heal`: once idle, the server re-prefills the rows a handoff left (in steps), so the entry is
    the model's own prefill row for row and the next turn says it reused no approximate row; /health
    counts what was healed. Without heal the same turn reuses approximate rows (the test above)."""
    import time

    import torch

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rarecache.engine.runner import spans
    from rarecache.serve import service as service_mod
    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    cfg = ServiceConfig(HandoffConfig(0.3, "rank"), heal=True, min_handoff_tokens=0)
    service = ChatService(models, maps, cfg)
    client = TestClient(create_app(service))
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, then def add return"}]
    client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 3})
    step, service_mod.HEAL_STEP = service_mod.HEAL_STEP, 4  # several idle steps for one entry
    try:
        r = client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 3})
        first = r.json()["rarecache"]
        assert first["handed_off_from"] == "small" and first["handed_off_tokens"] > first["recomputed_tokens"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with service.lock:
                if service._to_heal() is None:
                    break
            time.sleep(0.05)
    finally:
        service_mod.HEAL_STEP = step
    health = client.get("/health").json()
    (entry,) = service.store.entries["large"]
    held, n = entry.held, len(entry.held.ids)
    assert health["heal"] and health["healed_positions"] == n - first["reused_tokens"] > 4
    assert held.inexact_from is None and held.approximate == []
    llm = models["large"]
    cache = llm.runner.new_cache(1, n)
    toks, pos = spans([held.ids], [0], llm.runner.device)
    llm.runner.forward(toks, pos, cache, logits_at=None)
    assert torch.allclose(held.cache.k[:, :, :, :n], cache.k[:, :, :, :n], atol=1e-5, rtol=0)
    assert torch.allclose(held.cache.v[:, :, :, :n], cache.v[:, :, :, :n], atol=1e-5, rtol=0)
    messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "tokens and spaces"}]
    again = client.post("/v1/chat/completions", json={"model": "large", "messages": messages,
                                                      "max_tokens": 3}).json()["rarecache"]
    assert again["handed_off_from"] is None and again["reused_tokens"] > 0 and again["reused_approximate_tokens"] == 0
    service.close()


def test_row_error_is_the_mapped_rows_error_where_recomputed(fitted):
    """The candidate signal `row_error`, against the long way: the mapped rows (a plain `Mapper.apply`) against
    the rows the rung holds recomputed (at rung 0 the last position's, as plain transfer computed it)."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    pol = GatePolicy("rank", (0.2, 0.5), ALWAYS)
    snaps = target.new_cache(2, n)
    _, _, res = gated_handoff(source, target, mapper, ids, pol, climb_all=True, snapshots=snaps)
    mapped = target.new_cache(1, n)
    src_cache, _ = source.prefill([ids])
    mapper.apply(source, src_cache, target, mapped, torch.arange(n)[None])
    plain, _, _ = handoff(source, target, mapper, [ids], HandoffConfig(0.0, "rank"))

    def ratio(pos: list[int], cache) -> float:
        err = ref = 0.0
        for exact, before in ((cache.k, mapped.k), (cache.v, mapped.v)):
            e, b = exact[:, 0, :, pos].double(), before[:, 0, :, pos].double()
            err, ref = err + (e - b).pow(2).sum().item(), ref + e.pow(2).sum().item()
        return err, ref

    e0, r0 = ratio([n - 1], plain)
    assert res.rungs[0].row_error == pytest.approx(e0 / r0, rel=1e-4) and res.rungs[0].row_error > 0
    e1, r1 = ratio(res.handoff.positions[0], snaps.row(1))  # (the last position's row as this rung computed it)
    assert res.rungs[-1].row_error == pytest.approx(e1 / r1, rel=1e-4)
    _, _, online = gated_handoff(source, target, mapper, ids, pol)  # serving does not measure it
    assert all(r.row_error == 0.0 for r in online.rungs)


# -- the two views' signal (js_views) --------------------------------------------------------

def _other_view_rung(two, source, target, src_cache, snaps, k: int, n: int, rho: float, ids: list[int]):
    """The long way to rung k's cache with the rows still mapped from the map's other view: every row mapped
    through `two.plain()`, then the rows a suffix ladder's rung k recomputed (the newest budget(ρ, n)) copied
    from its snapshot. Returns that cache and its last-position logits (1, V)."""
    from rarecache.transfer.handoff import subset

    other = target.new_cache(1, n)
    two.plain().apply(source, src_cache, target, other, torch.arange(n)[None])
    new = list(range(n - budget(rho, n), n))
    other.k[:, 0, :, new] = snaps.k[:, k, :, new]
    other.v[:, 0, :, new] = snaps.v[:, k, :, new]
    return other, target.forward(*subset(torch.tensor([ids]), [torch.tensor([n - 1])]), other).logits

def test_js_views_is_each_rung_against_the_other_views_rows(fitted):
    """js_views, the long way: rung k's logits against the last position run over a cache whose rows still
    mapped come from the map's plain-transfer view and whose recomputed rows are rung k's (suffix: rung k
    recomputes the newest budget(ρ, n) positions). Rung 0 compares plain transfer through the two fits."""
    from rarecache.transfer.fitting.calibrate import with_plain

    source, target, mapper, prompts = fitted
    two = with_plain(mapper, (1.0, 0.5))
    assert two.has_plain_view
    ids = prompts[0]
    n = len(ids)
    rungs = (0.2, 0.5)
    snaps = target.new_cache(len(rungs), n)
    _, per_rung, rec = gated_handoff(source, target, two, ids, GatePolicy("suffix", rungs, NEVER), climb_all=True,
                                     snapshots=snaps)
    assert all(r.js_views > 0 and r.views_seconds > 0 for r in rec.rungs)
    assert rec.handoff.timings["views"] >= sum(r.views_seconds for r in rec.rungs)
    src_cache, _ = source.prefill([ids])
    for k, rho in enumerate(rungs):
        _, logits = _other_view_rung(two, source, target, src_cache, snaps, k, n, rho, ids)
        assert rec.rungs[k + 1].js_views == pytest.approx(js_bits(per_rung[k], logits[0]), rel=1e-3, abs=1e-7)
    _, ridge_plain, _ = handoff(source, target, mapper, [ids], HandoffConfig(0.0, "rank"))
    _, sharp_plain, _ = handoff(source, target, two, [ids], HandoffConfig(0.0, "rank"))
    assert rec.rungs[0].js_views == pytest.approx(js_bits(ridge_plain[0], sharp_plain[0]), rel=1e-3, abs=1e-7)
    # a map with one view measures nothing, and a policy on js_views refuses it with a clear error
    _, _, one = gated_handoff(source, target, mapper, ids, GatePolicy("suffix", rungs, NEVER), climb_all=True)
    assert all(r.js_views == 0 for r in one.rungs) and "views" not in one.handoff.timings
    with pytest.raises(RarecacheError, match="two views"):
        gated_handoff(source, target, mapper, ids, GatePolicy("suffix", rungs, 0.1, signal="js_views"))
    # serving on js runs no second view
    _, _, online = gated_handoff(source, target, two, ids, GatePolicy("suffix", rungs, ALWAYS))
    assert all(r.js_views == 0 for r in online.rungs) and "views" not in online.handoff.timings


def test_a_policy_on_js_views_decides_as_the_recorded_ladder_says(fitted):
    from rarecache.transfer.fitting.calibrate import with_plain

    source, target, mapper, prompts = fitted
    two = with_plain(mapper, (1.0, 0.5))
    ids = prompts[1]
    n = len(ids)
    rungs = (0.1, 0.3, 0.5)
    snaps = target.new_cache(len(rungs), n)
    _, per_rung, rec = gated_handoff(source, target, two, ids, GatePolicy("rank", rungs, NEVER), climb_all=True,
                                     snapshots=snaps)
    views = [r.js_views for r in rec.rungs[1:]]
    for th in sorted(set(views)):
        k = decide(views, th)
        _, logits, res = gated_handoff(source, target, two, ids, GatePolicy("rank", rungs, th, signal="js_views"))
        assert res.decision == "accept" and res.rho == rungs[k] and res.reason.startswith("js_views")
        torch.testing.assert_close(logits[0], per_rung[k], atol=1e-5, rtol=0)
    _, logits, res = gated_handoff(source, target, two, ids, GatePolicy("rank", rungs, min(views) / 2,
                                                                         signal="js_views"))
    own, out = target.prefill([ids], max_len=n)
    assert res.decision == "fallback" and "no rung had js_views" in res.reason
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)


def test_a_policy_on_nll_measures_it_alone_and_decides_as_the_recorded_ladder_says(fitted):
    """A served policy on nll computes the rung's surprisal at the prompt's own tokens exactly as the recorded
    ladder does (and nothing else: no probes, no source pass), accepts the rung the record says, with the
    same logits, and falls back below every rung's value."""
    source, target, mapper, prompts = fitted
    ids = prompts[1]
    n = len(ids)
    for sel, rungs in (("rank", (0.1, 0.3, 0.5)), ("suffix", (0.2, 0.5))):
        _, per_rung, rec = gated_handoff(source, target, mapper, ids, GatePolicy(sel, rungs, NEVER), climb_all=True,
                                         snapshots=target.new_cache(len(rungs), n))
        nll = [r.nll for r in rec.rungs[1:]]
        assert all(x > 0 for x in nll)
        for th in sorted(set(nll)):
            k = decide(nll, th)
            _, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy(sel, rungs, th, signal="nll"))
            assert res.decision == "accept" and res.rho == rungs[k] and res.reason.startswith("nll")
            torch.testing.assert_close(logits[0], per_rung[k], atol=1e-5, rtol=0)
            for online, recorded in zip(res.rungs[1:], rec.rungs[1:]):
                assert online.nll == pytest.approx(recorded.nll, rel=1e-4, abs=1e-6)
                assert set(online.signal_seconds) == {"nll"} and online.probe_cos == 0 and online.nll_gap == 0
        _, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy(sel, rungs, min(nll) / 2, signal="nll"))
        assert res.decision == "fallback" and "no rung had nll" in res.reason
        torch.testing.assert_close(logits, target.prefill([ids], max_len=n)[1].logits, atol=1e-5, rtol=0)
    # a policy that does not read nll measures nothing
    _, _, res = gated_handoff(source, target, mapper, ids, GatePolicy("rank", (0.1, 0.3), 10.0))
    assert all(r.nll == 0 and not r.signal_seconds for r in res.rungs)


def test_a_served_nll_counts_its_cost_once(fitted, monkeypatch):
    """Each rung's nll seconds are the surprisal read's (a fake clock: every read costs 1 s)."""
    from rarecache.transfer.gate import ladder

    source, target, mapper, prompts = fitted
    clock, real = [0.0], ladder._surprisal

    def slow(*a, **k):
        clock[0] += 1.0
        return real(*a, **k)

    monkeypatch.setattr(ladder, "_surprisal", slow)
    monkeypatch.setattr(ladder, "_now", lambda runner: clock[0])
    _, _, res = gated_handoff(source, target, mapper, prompts[0], GatePolicy("suffix", (0.3,), 1e9, signal="nll"))
    assert [r.signal_seconds["nll"] for r in res.rungs] == [1.0, 1.0]


def test_policy_signal_round_trip():
    from rarecache.commands.gate import SIGNALS as CLI_SIGNALS
    from rarecache.transfer.gate.policy import SIGNALS, gate_rule

    assert CLI_SIGNALS == SIGNALS
    pol = GatePolicy("suffix", (0.1, 0.3), 0.02, signal="js_views")
    data = json.loads(pol.to_json())
    assert data["signal"] == "js_views" and gate_rule(pol)["signal"] == "js_views"
    assert "signal" not in json.loads(GatePolicy("suffix").to_json())  # js: files as before
    with pytest.raises(RarecacheError, match="gate signal must be one of"):
        GatePolicy("suffix", signal="margin")


def test_policy_signal_file(tmp_path):
    f = tmp_path / "p.json"
    pol = GatePolicy("suffix", (0.1, 0.3), 0.02, fitted={"levels": [{"max_changed": 0.01, "max_bpb": 0.0025,
                                                                      "threshold": 0.5}]}, signal="js_views")
    f.write_text(pol.to_json())
    back = GatePolicy.load(f)
    assert back == pol and back.signal == "js_views" and back.at_loss(0.5).signal == "js_views"
    old = json.loads(GatePolicy("suffix", (0.1, 0.3), 0.02).to_json())  # a file written before the field
    f.write_text(json.dumps(old))
    assert GatePolicy.load(f).signal == "js"
    f.write_text(json.dumps({**old, "signal": "vibes"}))
    with pytest.raises(RarecacheError, match="gate signal must be one of"):
        GatePolicy.load(f)


def test_gate_fit_and_report_on_js_views(models, tmp_path):
    """Ladders through a map with two views record js_views and what it cost; `eval gate fit --signal js_views`
    thresholds it, the report reads it and counts its cost; ladders without it are refused clearly."""
    from rarecache.cli import main
    from rarecache.eval.gate_report import evaluate, read_ladders
    from rarecache.eval.results import load_results
    from rarecache.transfer.fitting.calibrate import with_plain

    source, target, mapper = models
    two = (source, target, with_plain(mapper, (1.0, 0.5)))
    held = _ladder_run(two, tmp_path, slice(0, 3), "held.jsonl")
    ev = _ladder_run(two, tmp_path, slice(3, 5), "ev.jsonl")
    rows = [r for r in load_results(ev) if r["arm"] == "ladder/rank"]
    assert rows and all(g["js_views"] > 0 for r in rows for g in r["ladder"])
    phases = [t["phases"] for t in load_results(ev.with_suffix(".timings.jsonl")) if t["arm"] == "ladder/rank"]
    assert all(p["views_map"] > 0 and len(p["views_rungs"]) == 5 for p in phases)
    lad = read_ladders(ev, signal="js_views")
    assert lad.js == [[g["js_views"] for g in r["ladder"]] for r in rows]
    pol = tmp_path / "policy.json"
    assert main(["eval", "gate", "fit", str(held), "--signal", "js_views", "--max-changed", "0.5",
                 "--out", str(pol)]) == 0
    policy = GatePolicy.load(pol)
    assert policy.signal == "js_views"
    assert main(["eval", "gate", "report", str(ev), "--policy", str(pol)]) == 0
    # the same decisions priced with and without the second view: accepting at rung 1 always costs more with it
    always = GatePolicy("rank", (0.1, 0.2, 0.3, 0.5), math.inf)
    with_views = evaluate(lad, GatePolicy("rank", (0.1, 0.2, 0.3, 0.5), math.inf, signal="js_views"))
    assert with_views["expected_speedup"] < evaluate(read_ladders(ev), always)["expected_speedup"]
    with pytest.raises(RarecacheError, match="read for signal js_views"):
        evaluate(lad, always)
    plain = _ladder_run(models, tmp_path, slice(0, 2), "one-view.jsonl")  # a map with one view: not recorded
    with pytest.raises(RarecacheError, match="does not record js_views"):
        read_ladders(plain, signal="js_views")
    assert main(["eval", "gate", "fit", str(plain), "--signal", "js_views", "--out", str(pol)]) == 2


def test_answer_views_scores_the_answer_under_both_views(models, tmp_path):
    """The candidate signal answer_views, the long way: each rung's answer scored again over a cache whose rows
    still mapped come from the map's other view (suffix: rung k recomputed the newest budget(ρ, n) positions)."""
    from rarecache.eval.results import load_results
    from rarecache.eval.run import answer_shift
    from rarecache.eval.scoring import continuation_logprobs
    from rarecache.transfer.fitting.calibrate import with_plain

    from .test_eval import ToyChoice

    source, target, mapper = models
    two = with_plain(mapper, (1.0, 0.5))
    ev = _ladder_run((source, target, two), tmp_path, slice(0, 2), "ev.jsonl", sel="suffix")
    rows = {(r["item"], r["arm"]): r for r in load_results(ev)}
    task = ToyChoice()
    for item in task.items()[0:2]:
        ids = source.encode(item.prompt)
        n = len(ids)
        conts = [source.tokenizer.encode(c, add_special_tokens=False) for c in item.continuations]
        lad = rows[(item.id, "ladder/suffix")]["ladder"]
        src_cache, _ = source.runner.prefill([ids])
        snaps = target.runner.new_cache(4, n)
        gated_handoff(source.runner, target.runner, two, ids, GatePolicy("suffix", (0.1, 0.2, 0.3, 0.5), NEVER),
                      climb_all=True, snapshots=snaps)
        for k, g in enumerate(lad):
            other, last = _other_view_rung(two, source.runner, target.runner, src_cache, snaps, k, n, g["rho"], ids)
            lp = continuation_logprobs(target.runner, other, last, n, conts)[0]
            b = task.score_likelihood(item, [sum(x) for x in lp])
            assert g["answer_views"] == pytest.approx(answer_shift(task.metric, g, b), abs=1e-4)
    assert any(g["answer_views"] > 0 for r in rows.values() if r["arm"] == "ladder/suffix" for g in r["ladder"])


def test_answer_shift():
    from rarecache.eval.run import answer_shift

    assert answer_shift("bpb", {"bpb": 0.5}, {"bpb": 0.75}) == 0.25
    a = {"logprobs": [0.0, -1.0], "prediction": 0, "prediction_norm": 1}
    same = {"logprobs": [0.0, -1.0], "prediction": 0, "prediction_norm": 1}
    moved = {"logprobs": [-1.0, 0.0], "prediction": 1, "prediction_norm": 1}
    assert answer_shift("correct", a, same) == 0
    tv = abs(1 / (1 + math.exp(-1)) - 1 / (1 + math.exp(1)))
    assert answer_shift("correct", a, moved) == pytest.approx(tv + 1)
    assert answer_shift("correct_norm", a, moved) == pytest.approx(tv)  # the normalised answer did not move
