"""The gate policy's fit on held-apart ladders: the cheapest (first rung, rungs climbed, threshold, margin
floor) that keeps every task within its loss bound. Only `eval/gate_report.py` calls it; serving reads the
policy file it writes (`transfer/gate/policy.py`).

Work is what is minimised, in prefill-equivalents as measured: the first rung climbed reruns its whole
set (a direct handoff, share = its cost), each later one the positions it reran (`run`, exact climbing
from the first position it adds), and a fallback adds the target's own prefill (1) to the rungs it
climbed first, so a policy that would fall back anyway does so early, and one that usually accepts a
high rung starts there. Ladders recorded before `run` existed were climbed the old, nested way: each
rung's work is then its increment of cost, and only full climbs from the first rung are searched.

Every threshold at which some decision changes is tried at once per (first rung, rungs climbed, margin
floor): a rung's accepted index is the first whose running minimum of the signal (+inf where the margin
floor fails) is at most the threshold, so each total is a sum of steps at those minima (one sort and a
cumulative sum, not a pass per threshold).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..transfer.gate.policy import climbed_signals


class Item(NamedTuple):
    """One held-apart item's ladder: per rung its signal, loss and cost (recomputed share); optionally its
    top-2 margin, its js against plain transfer (js_plain: starting above the first rung) and the share
    of positions it ran."""

    js: list[float]
    loss: list[float]
    cost: list[float]
    margin: list[float] | None = None
    js_plain: list[float] | None = None
    run: list[float] | None = None


class Fit(NamedTuple):
    threshold: float
    min_margin: float | None
    outcome: dict[str, dict]  # per group: loss, cost (a fallback as 1.0), work, fallback share, n
    max_rungs: int | None
    first_rung: int = 0


def candidate_thresholds(ladders: list[list[float]]) -> list[float]:
    """Every threshold at which some decision changes, ascending, with 'always fall back' first."""
    return [-1.0, *sorted({float(d) for js in ladders for d in js})]


def _steps(items: list[Item], first: int, most: int | None, floor: float | None, start_run: bool
           ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per item the running minima of its climbed signals, the value of each quantity at each climbed rung
    and at a fallback: (minima (N, K), per quantity (N, K), per quantity (N,))."""
    quantities = ("loss", "cost", "work", "fallback")
    sig, vals, fb = [], {k: [] for k in quantities}, {k: [] for k in quantities}
    for it in items:
        seq = climbed_signals(it.js, first, it.js_plain)[:most]
        k = len(seq)
        s = np.asarray(seq, dtype=float)
        if floor is not None:
            s = np.where(np.asarray(it.margin[first:first + k], dtype=float) >= floor, s, np.inf)
        sig.append(np.minimum.accumulate(s) if k else s)
        cost = np.asarray(it.cost, dtype=float)
        if start_run:  # measured: the first rung climbed runs its whole set, later ones what they reran
            run = np.asarray(it.run, dtype=float)[first:first + k].copy()
            if k:
                run[0] = cost[first]
        else:  # nested (older records): each rung's increment of cost
            run = np.diff(cost, prepend=0.0)[first:first + k]
        work = np.cumsum(run)
        vals["loss"].append(np.asarray(it.loss[first:first + k], dtype=float))
        vals["cost"].append(cost[first:first + k])
        vals["work"].append(work)
        vals["fallback"].append(np.zeros(k))
        fb["loss"].append(0.0)
        fb["cost"].append(1.0)
        fb["work"].append(1.0 + (work[-1] if k else 0.0))
        fb["fallback"].append(1.0)
    return (np.asarray(sig), {q: np.asarray(v) for q, v in vals.items()},
            {q: np.asarray(v) for q, v in fb.items()})


def _totals(items: list[Item], first: int, most: int | None, floor: float | None, start_run: bool,
            thresholds: np.ndarray) -> dict[str, np.ndarray]:
    """Mean loss, cost, work and fallback share over `items` at every threshold (M,)."""
    minima, vals, fb = _steps(items, first, most, floor, start_run)
    n = max(1, len(items))
    out = {}
    for q in vals:
        if minima.size == 0:
            out[q] = np.full(len(thresholds), fb[q].sum() / n if len(items) else 0.0)
            continue
        nxt = np.concatenate([vals[q][:, 1:], fb[q][:, None]], axis=1)  # (N, K): the value one rung further
        delta = (vals[q] - nxt).ravel()  # accepting at or below rung k instead of above it
        at = minima.ravel()
        order = np.argsort(at, kind="stable")
        steps = np.concatenate([[0.0], np.cumsum(delta[order])])
        out[q] = (fb[q].sum() + steps[np.searchsorted(at[order], thresholds, side="right")]) / n
    return out


def fit_threshold(groups: dict[str, list], bounds: dict[str, float], margins: bool = False) -> Fit:
    return fit_thresholds(groups, [bounds], margins)[0]


def fit_thresholds(groups: dict[str, list], bounds_list: list[dict[str, float]], margins: bool = False) -> list[Fit]:
    """The policy that computes least while every group's mean loss stays within its bound, per set of bounds.

    `groups`: per task, per held-apart item, an `Item` (or a tuple in its order), where a rung's loss is
    what accepting it costs against the target's own answer (1 for a changed multiple-choice answer, the
    bpb increase for a continuation) and its cost the recomputed share; a fallback loses nothing and
    costs 1. Searched: the first rung (when every item records js_plain and run), the most rungs to climb,
    with `margins` a floor on the top-2 margin over deciles of the observed margins, and every threshold.
    Ties go to the larger threshold.
    """
    groups = {g: [Item(*it) for it in items] for g, items in groups.items()}
    every = [it for items in groups.values() for it in items]
    rungs = max((len(it.js) for it in every), default=0)
    measured = bool(every) and all(it.run is not None and it.js_plain is not None for it in every)
    floors: list[float | None] = [None]
    if margins:
        ms = [m for it in every for m in it.margin]
        floors += sorted({float(q) for q in np.quantile(ms, np.linspace(0.1, 0.9, 9))}) if ms else []
    values = [it.js for it in every] + ([it.js_plain for it in every] if measured else [])
    ths = np.asarray(candidate_thresholds(values))
    at_once = {g: {"loss": 0.0, "cost": 1.0, "work": 1.0, "fallback": 1.0, "n": len(items)} if items else
               {"loss": 0.0, "cost": 0.0, "work": 0.0, "fallback": 0.0, "n": 0} for g, items in groups.items()}
    table = [(-1.0, None, 0, 0, {g: {q: np.asarray([v]) for q, v in o.items() if q != "n"}
                                 for g, o in at_once.items()}, np.asarray([-1.0]))]
    for first in range(rungs if measured else min(1, rungs)):
        top = rungs - first
        for most in [*range(1, top), None]:
            for floor in floors:
                table.append((None, floor, most, first, {g: _totals(items, first, most, floor, measured, ths)
                                                         for g, items in groups.items()}, ths))
    fits = []
    for bounds in bounds_list:
        best = (math.inf, None)
        for _, floor, most, first, out, th in table:
            ok = np.all([out[g]["loss"] <= bounds[g] + 1e-12 for g in out], axis=0)  # (M,)
            if not ok.any():
                continue
            work = np.mean([out[g]["work"] for g in out], axis=0)
            c = work[ok].min()
            if c < best[0] - 1e-12:
                pick = np.flatnonzero(ok & (work <= c + 1e-12))[-1]  # ties: the larger threshold
                best = (c, (float(th[pick]), floor, most, first, out, pick))
        th, floor, most, first, out, pick = best[1]
        outcome = {g: {q: float(v[pick]) for q, v in o.items()} | {"n": len(groups[g])} for g, o in out.items()}
        fits.append(Fit(th, floor, outcome, most, first))
    return fits
