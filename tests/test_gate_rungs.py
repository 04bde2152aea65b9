"""The gate's rungs are direct handoffs (every selector), what climbing costs, the signals an evaluation
records (against the long way), their AUCs on constructed data, and the fit's first rung (against a brute
force)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from rarecache.errors import RarecacheError
from rarecache.eval.gate_fit import Item, fit_threshold
from rarecache.transfer.gate.policy import RUNGS, GatePolicy, climbed_signals, decide
from rarecache.transfer.gate.ladder import PROBES, gated_handoff, rung_run
from rarecache.transfer.handoff import HandoffConfig, budget, handoff, subset
from rarecache.transfer.selectors import SELECTORS

NEVER, ALWAYS = -1.0, math.inf
# oracles read the target's prefill; a two-pass selector has no one order for the rungs (the gate refuses it)
SELECTORS_SERVED = [name for name, s in SELECTORS.items() if not (s.oracle or s.two_pass)]


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("sel", SELECTORS_SERVED)
def test_every_rung_is_a_direct_handoff(fitted, sel):
    """At every rung, for every selector: the recorded ladder (climbing, measuring), a policy that starts
    there (one direct handoff) and a policy that climbs to it from the first rung all hold the cache and
    logits of a direct handoff at that rung's rho."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    snaps = target.new_cache(len(RUNGS), n)
    _, per_rung, rec = gated_handoff(source, target, mapper, ids, GatePolicy(sel, RUNGS, NEVER), climb_all=True,
                                     snapshots=snaps)
    js = [r.js for r in rec.rungs[1:]]
    direct = [handoff(source, target, mapper, [ids], HandoffConfig(rho, sel)) for rho in RUNGS]
    for k, (d_cache, d_logits, d_res) in enumerate(direct):
        assert rec.rungs[k + 1].recomputed == len(d_res.positions[0]) == budget(RUNGS[k], n)
        close(per_rung[k], d_logits[0])
        close(snaps.k[:, k, :, :n], d_cache.k[:, 0, :, :n])
        close(snaps.v[:, k, :, :n], d_cache.v[:, 0, :, :n])
        cache, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy(sel, RUNGS, ALWAYS, first_rung=k,
                                                                                    max_rungs=1))
        assert res.decision == "accept" and res.rho == RUNGS[k] and res.handoff.positions == d_res.positions
        assert [r.rho for r in res.rungs] == [0.0, RUNGS[k]] and res.rungs[1].run == len(d_res.positions[0])
        close(logits[0], d_logits[0])
        close(cache.k[:, 0, :, :n], d_cache.k[:, 0, :, :n])
    for th in sorted(set(js)):  # climbing from the first rung to the one the threshold accepts
        k = decide(js, th)
        cache, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy(sel, RUNGS, th))
        assert res.rho == RUNGS[k] and len(res.rungs) == k + 2
        close(logits[0], direct[k][1][0])
        close(cache.v[:, 0, :, :n], direct[k][0].v[:, 0, :, :n])


def test_a_rung_mid_conversation_is_a_direct_handoff(fitted):
    """The target already holds its own rows for a prefix: a rung is still the direct handoff of the rest."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n, kept = len(ids), 11
    own, _ = target.prefill([ids[:kept]], max_len=n)
    for k, rho in enumerate(RUNGS):
        held = target.new_cache(1, n)
        held.copy_prefix(own, kept)
        d_cache, d_logits, d_res = handoff(source, target, mapper, [ids], HandoffConfig(rho, "suffix+attn"),
                                           target_cache=held, target_kept=[kept])
        held2 = target.new_cache(1, n)
        held2.copy_prefix(own, kept)
        pol = GatePolicy("suffix+attn", RUNGS, ALWAYS, min_margin=-math.inf if k == 0 else math.inf)
        cache, logits, res = gated_handoff(source, target, mapper, ids, GatePolicy(
            "suffix+attn", RUNGS, ALWAYS, first_rung=k, max_rungs=1) if k else pol, target_cache=held2,
            target_kept=kept)
        assert res.rho == rho and res.handoff.positions == d_res.positions
        close(logits[0], d_logits[0])
        close(cache.k[:, 0, :, :n], d_cache.k[:, 0, :, :n])


def test_rung_run_reruns_from_the_first_added_position():
    t = torch.tensor
    assert rung_run(t([3, 7, 9]), t([1, 3, 5, 7, 9])).tolist() == [1, 3, 5, 7, 9]  # an early addition: all
    assert rung_run(t([3, 7, 9]), t([3, 7, 8, 9])).tolist() == [8, 9]  # a late one: from it on
    assert rung_run(t([3, 7, 9]), t([3, 7, 9])).tolist() == [9]  # nothing added: the last position
    assert rung_run(t([], dtype=torch.long), t([9])).tolist() == [9]  # rung 0


def test_climbing_cost_is_measured(fitted):
    """Each rung records the positions it ran: suffix reruns its whole set at every rung (its additions come
    first), so the whole ladder costs the sum of its budgets; rank runs what `rung_run` says of the direct
    handoffs' sets."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    for sel in ("suffix", "rank"):
        for climb_all in (True, False):  # (the serving pass counts the same)
            pol = GatePolicy(sel, RUNGS, NEVER if climb_all else ALWAYS, min_margin=None if climb_all else math.inf)
            _, _, rec = gated_handoff(source, target, mapper, ids, pol, climb_all=climb_all)
            sets = [torch.tensor([n - 1])] + [torch.tensor(handoff(source, target, mapper, [ids], HandoffConfig(
                rho, sel))[2].positions[0]) for rho in RUNGS]
            runs = [r.run for r in rec.rungs]
            assert runs == [1] + [len(rung_run(a, b)) for a, b in zip(sets, sets[1:])]
            if sel == "suffix":
                assert runs[1:] == [budget(r, n) for r in RUNGS]
                assert sum(runs[1:]) / n == pytest.approx(sum(budget(r, n) for r in RUNGS) / n)  # ~ 1.1 prefills


def _bits(logits: torch.Tensor, nxt: list[int]) -> list[float]:
    lp = torch.log_softmax(logits.double(), -1)
    return (-lp[torch.arange(len(nxt)), torch.tensor(nxt)] / math.log(2)).tolist()


def test_signals_equal_the_long_way(fitted):
    """nll, nll_shift, nll_gap, probe_cos and row_error per layer at every rung, each recomputed from a direct
    handoff at the rung's rho, the source's own prefill and the mapped cache."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    rungs = (0.2, 0.5)
    _, _, rec = gated_handoff(source, target, mapper, ids, GatePolicy("rank", rungs, NEVER), climb_all=True)
    whole = torch.tensor([ids])
    src_cache = source.new_cache(1, n)
    src_bits = _bits(source.forward(whole, torch.arange(n)[None], src_cache, logits_at="all").logits[0, :-1],
                     ids[1:])
    mapped = target.new_cache(1, n)
    mapper.apply(source, src_cache, target, mapped, torch.arange(n)[None])
    below: dict[int, float] = {}
    for k, rho in enumerate(rungs):
        d_cache, _, d_res = handoff(source, target, mapper, [ids], HandoffConfig(rho, "rank"))
        chosen = torch.tensor(d_res.positions[0])
        copy = target.new_cache(1, n)
        copy.copy_prefix(d_cache, n)
        tok, pos = subset(whole, [chosen])
        h, cos_sin, cos = target.embed(tok), target.cos_sin(pos), []
        for i in range(target.num_layers):  # the rung's positions again over its own cache: the same rows
            q, kk, vv = target.qkv(i, h, cos_sin)
            copy.write(i, pos, kk, vv)
            out, _ = target.attend(i, q, pos, copy)
            ref, _ = target.attend(i, q[:, :, -PROBES:], pos[:, -PROBES:], mapped)
            cos.append(torch.nn.functional.cosine_similarity(out[:, :, -PROBES:], ref, dim=-1).mean().item())
            h = target.finish(i, h, out)
        scored = [p for p in chosen.tolist() if p < n - 1]
        mine = dict(zip(scored, _bits(target.model.logits(h)[0, :len(scored)], [ids[p + 1] for p in scored])))
        r = rec.rungs[k + 1]
        nll = sum(mine.values()) / len(scored)
        assert r.nll == pytest.approx(nll, rel=1e-4)
        assert r.nll_shift == pytest.approx(nll - sum(src_bits[p] for p in scored) / len(scored), rel=1e-4, abs=1e-6)
        gap = [abs(mine[p] - below.get(p, src_bits[p])) for p in scored]
        assert r.nll_gap == pytest.approx(sum(gap) / len(gap), rel=1e-4) and r.nll_gap > 0
        assert r.probe_cos == pytest.approx(sum(cos) / len(cos), abs=1e-5) and r.probe_cos < 1
        err = [((d_cache.k[i, 0, :, chosen] - mapped.k[i, 0, :, chosen]).double().pow(2).sum()
                + (d_cache.v[i, 0, :, chosen] - mapped.v[i, 0, :, chosen]).double().pow(2).sum()).item()
               / (d_cache.k[i, 0, :, chosen].double().pow(2).sum() + d_cache.v[i, 0, :, chosen].double().pow(2).sum()
                  ).item() for i in range(target.num_layers)]
        assert r.row_error_layers == pytest.approx(err, rel=1e-4)
        assert set(r.signal_seconds) == {"nll", "source_nll", "probe", "row_error"}
        assert all(v >= 0 for v in r.signal_seconds.values()) and r.signal_seconds["probe"] > 0
        below = mine
    assert rec.rungs[1].signal_seconds["source_nll"] > 0  # the source's surprisals: read once, at the first rung
    _, _, online = gated_handoff(source, target, mapper, ids, GatePolicy("rank", rungs, ALWAYS))
    assert all(r.nll == 0 and r.signal_seconds == {} for r in online.rungs)  # serving measures none of it


# -- the AUCs, on constructed data with a known answer -----------------------------------------

def test_signal_aucs_on_constructed_ladders():
    from rarecache.eval.gate_auc import COMBINED, signal_aucs

    rng = np.random.default_rng(0)
    rungs, n = [0.1, 0.3], 300
    changed = (rng.random((n, 2)) < 0.3).tolist()
    rows = [[{"js": float(c) + 0.1 * rng.random(),  # separates the classes: AUC 1
              "probe_cos": 1.0 - 0.5 * c - 0.1 * rng.random(),  # the same, lower when changed: oriented, AUC 1
              "nll": rng.random()}  # noise: AUC 1/2
             for c in cs] for cs in changed]
    out = signal_aucs(rows, changed, rungs, n_boot=200)
    assert set(out["pooled"]) == {"js", "probe_cos", "nll", COMBINED} and set(out["rungs"]) == {"0.1", "0.3"}
    for name in ("js", "probe_cos", COMBINED):
        for cell in (out["pooled"][name], *(out["rungs"][r][name] for r in out["rungs"])):
            assert cell["auc"] > 0.99 and cell["ci"][0] > 0.97
    noise = out["pooled"]["nll"]
    assert noise["ci"][0] < 0.5 < noise["ci"][1] and abs(noise["auc"] - 0.5) < 0.1
    assert out["pooled"]["js"]["n"] == 2 * n and out["pooled"]["js"]["changed"] == sum(map(sum, changed))
    assert out["rungs"]["0.3"]["js"]["n"] == n


def test_the_combination_is_cross_validated():
    """Two signals each half the answer: their combination is near perfect where each alone is not; pure noise
    stays near 1/2 out of fold (an in-sample fit of five noise features would not)."""
    from rarecache.eval.gate_auc import auc, cross_validated, logistic

    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 2))
    y = (x[:, 0] + x[:, 1] > 0)
    item = np.arange(400)
    both = auc(cross_validated(x, y, item), y)
    assert both > 0.97 and both > max(auc(x[:, 0], y), auc(x[:, 1], y)) + 0.1
    noise, labels = rng.normal(size=(60, 5)), rng.random(60) < 0.5
    w = logistic(noise, labels.astype(float), l2=1e-6)
    in_sample = auc(noise @ w[:-1], labels)
    out_of_fold = auc(cross_validated(noise, labels, np.arange(60)), labels)
    assert in_sample > 0.7 and out_of_fold < in_sample - 0.15
    # the weights: data drawn from a known logistic model come back
    big = rng.normal(size=(20000, 2))
    p = 1 / (1 + np.exp(-(2 * big[:, 0] - big[:, 1] + 0.5)))
    w = logistic(big, (rng.random(20000) < p).astype(float), l2=1e-6)
    assert w == pytest.approx([2, -1, 0.5], abs=0.1)


def test_bpb_changed_means_worse_by_more_than_the_bound(tmp_path):
    """An improvement is no change; worse by 0.01 or less neither."""
    from rarecache.eval.gate_report import read_ladders

    path = tmp_path / "b.jsonl"
    rows = []
    for k, (target, rung) in enumerate([(1.0, 0.5), (1.0, 1.005), (1.0, 1.02)]):
        rows.append({"task": "custom_bpb", "arm": "target", "item": f"i{k}", "prompt_tokens": 10, "bpb": target})
        rows.append({"task": "custom_bpb", "arm": "ladder/suffix", "item": f"i{k}", "prompt_tokens": 10,
                     "ladder": [{"rho": 0.5, "recomputed": 5, "run": 5, "js": 0.1, "js_plain": 0.1, "bpb": rung}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lad = read_ladders(path)
    assert lad.changed == [[False], [False], [True]] and lad.run == [[0.5]] * 3
    assert [x[0] for x in lad.loss] == pytest.approx([-0.5, 0.005, 0.02])
    # ladders recorded before exact rungs (no run) cannot say what a policy starting higher would do
    from rarecache.eval.gate_report import evaluate

    two = path.with_name("two.jsonl")
    old = [{**r, "ladder": [{k: v for k, v in g.items() if k != "run"} for g in r["ladder"] * 2]} if "ladder" in r
           else r for r in rows]
    for r in old:
        if "ladder" in r:
            r["ladder"][1] = {**r["ladder"][1], "rho": 0.6}
    two.write_text("".join(json.dumps(r) + "\n" for r in old))
    lad = read_ladders(two)
    assert lad.run is None and lad.rungs == [0.5, 0.6]
    assert evaluate(lad, GatePolicy("suffix", (0.5, 0.6), ALWAYS))["fallback_share"] == 0
    with pytest.raises(RarecacheError, match="before rungs were direct handoffs"):
        evaluate(lad, GatePolicy("suffix", (0.5, 0.6), ALWAYS, first_rung=1))


# -- the fit's first rung -------------------------------------------------------------------------

def test_fit_starts_high_when_low_rungs_are_wasted():
    """Rungs 0.1 and 0.2 always change the answer: climbing through them before accepting 0.3 costs their
    reruns too; starting at 0.3 (one direct handoff) costs 0.3."""
    cost = [0.1, 0.2, 0.3, 0.5]
    easy = Item([0.5, 0.4, 0.1, 0.05], [1, 1, 0, 0], cost, None, [0.5, 0.45, 0.1, 0.2], cost)
    hard = Item([0.5, 0.4, 0.3, 0.01], [1, 1, 1, 0], cost, None, [0.5, 0.45, 0.3, 0.01], cost)
    fit = fit_threshold({"t": [easy] * 3 + [hard]}, {"t": 0.0})
    assert fit.first_rung == 2 and fit.outcome["t"]["loss"] == 0
    assert fit.outcome["t"]["work"] == pytest.approx((3 * 0.3 + 0.3 + 0.5) / 4)
    assert fit.outcome["t"]["cost"] == pytest.approx((3 * 0.3 + 0.5) / 4)
    pol = GatePolicy("suffix", tuple(RUNGS), fit.threshold, fit.min_margin, {}, fit.max_rungs, "js", fit.first_rung)
    for it in (easy, hard):  # what the policy does on each item: the rung with loss 0
        k = decide(climbed_signals(it.js, pol.first_rung, it.js_plain), pol.threshold, max_rungs=pol.max_rungs)
        assert it.loss[pol.first_rung + k] == 0
    nested = fit_threshold({"t": [Item(*easy[:3])] * 3 + [Item(*hard[:3])]}, {"t": 0.0})  # older records
    assert nested.first_rung == 0 and nested.outcome["t"]["work"] == pytest.approx((3 * 0.3 + 0.5) / 4)


def test_fit_is_the_cheapest_policy_by_brute_force():
    rng = np.random.default_rng(3)
    groups = {}
    for g in ("a", "b"):
        items = []
        for _ in range(25):
            cost = sorted(rng.uniform(0.05, 0.6, 4).round(3).tolist())
            items.append(Item(rng.random(4).round(2).tolist(), (rng.random(4) < 0.4).astype(float).tolist(), cost,
                              rng.random(4).tolist(), rng.random(4).round(2).tolist(),
                              [c * rng.uniform(0.3, 1) for c in cost]))
        groups[g] = items
    bounds = {"a": 0.1, "b": 0.2}
    fit = fit_threshold(groups, bounds)
    best = math.inf
    ths = [-1.0, *sorted({v for items in groups.values() for it in items for v in it.js + it.js_plain})]
    for first in range(4):
        for most, th in itertools.product([*range(1, 4 - first), None], ths):
            total = []
            for g, items in groups.items():
                loss = work = 0.0
                for it in items:
                    k = decide(climbed_signals(it.js, first, it.js_plain), th, max_rungs=most)
                    runs = [it.cost[first]] + list(it.run[first + 1:])
                    if k is None:
                        climbed = len(it.js[first:][:most])
                        work += 1 + sum(runs[:climbed])
                    else:
                        loss, work = loss + it.loss[first + k], work + sum(runs[:k + 1])
                if loss / len(items) > bounds[g] + 1e-12:
                    break
                total.append(work / len(items))
            else:
                best = min(best, sum(total) / len(total))
    best = min(best, 1.0)  # falling back at once
    assert sum(o["work"] for o in fit.outcome.values()) / 2 == pytest.approx(best)
    assert all(fit.outcome[g]["loss"] <= bounds[g] + 1e-12 for g in groups)


def test_policy_first_rung_round_trip_and_validation(tmp_path):
    pol = GatePolicy("suffix", RUNGS, 0.1, first_rung=2, max_rungs=1)
    assert pol.climbed == (0.3,)
    f = tmp_path / "p.json"
    f.write_text(pol.to_json())
    assert GatePolicy.load(f) == pol and json.loads(f.read_text())["first_rung"] == 2
    assert "first_rung" not in json.loads(GatePolicy("suffix").to_json())  # (files as before when 0)
    for bad, msg in (({"first_rung": 4}, "first_rung"), ({"first_rung": True}, "first_rung"),
                     ({"first_rung": 2, "max_rungs": 3}, "max_rungs must be a whole number from 0 to 2")):
        with pytest.raises(RarecacheError, match=msg):
            GatePolicy("suffix", RUNGS, 0.1, **bad)


def test_auc_by_ranks_equals_counting_pairs():
    from rarecache.eval.gate_auc import auc

    rng = np.random.default_rng(5)
    for _ in range(20):
        s, y = rng.integers(0, 6, 40).astype(float), rng.random(40) < 0.3  # many ties
        pos, neg = s[y], s[~y]
        want = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
        assert auc(s, y) == pytest.approx(want)


def test_auc_interval_draws_equal_resampling_by_hand():
    """The weighted draws are item resamples: scoring one block's draws by hand (repeating each item as often
    as it was drawn) gives the same AUCs, so the interval matches."""
    from rarecache.eval.gate_auc import auc, auc_ci

    rng = np.random.default_rng(2)
    items = [(rng.integers(0, 5, 3).astype(float).tolist(), (rng.random(3) < 0.4).tolist()) for _ in range(30)]
    point, lo, hi = auc_ci(items, n_boot=200, seed=7)
    draws = np.random.default_rng(7).multinomial(30, np.full(30, 1 / 30), size=200)
    by_hand = [auc([s for i, c in enumerate(d) for _ in range(c) for s in items[i][0]],
                   [x for i, c in enumerate(d) for _ in range(c) for x in items[i][1]]) for d in draws]
    want = np.quantile([b for b in by_hand if b == b], [0.025, 0.975])
    assert (lo, hi) == pytest.approx(tuple(want))
    assert point == auc([s for it in items for s in it[0]], [x for it in items for x in it[1]])
