"""The quality gate on recorded ladders: fit its threshold on held-apart items, then read off what
the policy does on evaluated items (accuracy against the target, fallbacks, recomputed share,
expected speed-up), and how well its signal predicts a changed answer.

An evaluation's ladder arm (`arms.py`) records every rung of `transfer/gate/policy.py`'s ladder with its
signal and its answer; the online gate stops at the rung the policy accepts, and a test holds the
two equal, so a policy's outcome is read off the record without rerunning the models. A fallback
answers with the target's own prefill: the item's target arm.

A rung's loss, what accepting it costs against the target's own answer: for multiple choice 1 when
the answer changed (the gate bounds changed answers, which bounds the accuracy lost either way),
for bits per byte the increase in bpb. A rung's answer "changed" (the signals' AUCs, `agreement`): another
multiple-choice answer, or a bpb worse than the target's by more than `CHANGED_BPB` (an improvement is
no change). Its cost is the share of prompt positions recomputed; a
fallback costs 1.0 (the target's own prefill) and loses nothing. `LOSSES`: "changed" is that
per-request bound; "accuracy" bounds what the evaluation measures instead, the mean accuracy lost
(the target right and the rung wrong counts 1, the other way round −1, a change between two wrong
answers 0): where the target's own answers are near coin flips (0-shot MMLU) most changes are of
the last kind, and bounding them forces a fallback on nearly every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import RarecacheError
from ..transfer.gate.policy import SIGNALS, GatePolicy, climbed_signals, decide, rungs_climbed
from .answers import same_answer
from .gate_auc import auc, auc_ci, signal_aucs  # noqa: F401  (auc: scripts/gate_signals.py reads it here)
from .gate_fit import Item, fit_thresholds
from .report import format_p
from .results import load_results, map_sha256, sibling
from .significance import mcnemar, paired_diff_ci

CHANGED_BPB = 0.01  # bits per byte: a bpb item's "answer changed" (for the signal's AUC) past this
LOSSES = ("changed", "accuracy")  # what a multiple-choice rung's loss counts (module docstring)


@dataclass
class Ladders:
    """One task's ladder arm and target arm, item by item (items that have both)."""

    task: str
    metric: str
    loss_kind: str  # LOSSES: what a multiple-choice rung's loss counts
    arm: str
    selector: str
    rungs: list[float]
    items: list[str]
    map_sha256: str | None
    signal: str = "js"  # which recorded signal `js` holds (transfer.gate.policy.SIGNALS)
    js: list[list[float]] = field(default_factory=list)  # per item, per rung: the signal
    margin: list[list[float]] | None = field(default_factory=list)  # per item, per rung: top-2 margin (None: the
    # records predate it)
    loss: list[list[float]] = field(default_factory=list)
    cost: list[list[float]] = field(default_factory=list)
    value: list[list[float]] = field(default_factory=list)  # the metric per rung
    target: list[float] = field(default_factory=list)  # the target's metric
    changed: list[list[bool]] = field(default_factory=list)
    js_plain: list[list[float]] = field(default_factory=list)  # per item, per rung: js against plain transfer
    run: list[list[float]] | None = field(default_factory=list)  # per item, per rung: share of positions it ran
    # (None: ladders recorded before exact climbing)
    rows: list[list[dict]] = field(default_factory=list)  # per item, the rungs as recorded (every signal)
    seconds: list[dict] = field(default_factory=list)  # per item: map, score, rung_recompute (rung 0 first),
    # target_prefill


def read_ladders(path: Path, arm: str | None = None, loss: str = "changed", signal: str = "js") -> Ladders:
    """The ladder arm (the only one, or `arm`) and the target arm of a results file; `loss` (`LOSSES`):
    what a multiple-choice rung's loss counts; `signal` (`SIGNALS`): which recorded signal a policy reads."""
    from .tasks import TASKS

    if loss not in LOSSES:
        raise RarecacheError(f"unknown gate loss {loss!r}: {', '.join(LOSSES)}")
    if signal not in SIGNALS:
        raise RarecacheError(f"unknown gate signal {signal!r}: {', '.join(SIGNALS)}")
    if not path.is_file():
        raise RarecacheError(f"no results file {path}")
    rows = load_results(path)
    arms = sorted({r["arm"] for r in rows if r["arm"].startswith("ladder/")})
    if not arms:
        raise RarecacheError(f"{path} has no ladder arm (run `eval run` with --arms target ladder:SELECTOR ...)")
    if arm is None and len(arms) > 1:
        raise RarecacheError(f"{path} has several ladder arms ({', '.join(arms)}): pick one with --arm")
    arm = arm or arms[0]
    if arm not in arms:
        raise RarecacheError(f"{path} has no arm {arm}; its ladder arms: {', '.join(arms)}")
    task = rows[0]["task"]
    metric = TASKS[task].metric if task in TASKS else ("bpb" if "bpb" in rows[0] else "correct")
    target = {r["item"]: r for r in rows if r["arm"] == "target"}
    ladder = {r["item"]: r for r in rows if r["arm"] == arm}
    times = _timings(path, arm)
    items = [i for i in ladder if i in target]
    if not items:
        raise RarecacheError(f"{path}: no item has both the target arm and {arm}")
    out = Ladders(task, metric, loss, arm, arm.split("/", 1)[1].split("@")[0],
                  [g["rho"] for g in ladder[items[0]]["ladder"]], items, map_sha256(path, arm.partition("@")[2]),
                  signal)
    if any(signal not in g for i in items for g in ladder[i]["ladder"]):
        raise RarecacheError(f"{path}: {arm} does not record {signal} on every item (it is recorded through maps "
                             "with a plain-transfer view, by ladders run since it was added): run the ladder again")
    for i in items:
        t, rungs = target[i], ladder[i]["ladder"]
        out.js.append([g[signal] for g in rungs])
        out.js_plain.append([g.get("js_plain", 0.0) for g in rungs])
        out.run.append([g.get("run", -1) / ladder[i]["prompt_tokens"] for g in rungs])
        out.rows.append(rungs)
        out.margin.append([g.get("margin") for g in rungs])
        out.cost.append([g["recomputed"] / ladder[i]["prompt_tokens"] for g in rungs])
        out.value.append([float(g[metric]) for g in rungs])
        out.target.append(float(t[metric]))
        if metric == "bpb":
            out.loss.append([g["bpb"] - t["bpb"] for g in rungs])
            out.changed.append([g["bpb"] - t["bpb"] > CHANGED_BPB for g in rungs])
        else:
            out.changed.append([not same_answer(g, t, metric) for g in rungs])  # (answers.py's one rule)
            out.loss.append([float(c) for c in out.changed[-1]] if loss == "changed"
                            else [float(t[metric]) - float(g[metric]) for g in rungs])
        out.seconds.append(times.get(i, {}))
    if any(m is None for ms in out.margin for m in ms):
        out.margin = None
    if any(r < 0 for rs in out.run for r in rs):
        out.run = None
    return out


def _timings(path: Path, arm: str) -> dict[str, dict]:
    tf = sibling(path, ".timings.jsonl")
    if not tf.is_file():
        return {}
    return {t["item"]: t["phases"] for t in load_results(tf) if t.get("arm") == arm}


LEVELS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)  # the fit's bounds times these, stored beside it (GatePolicy.at_loss)


def fit(ladders: list[Ladders], max_changed: float, max_bpb: float) -> GatePolicy:
    """One policy for all the tasks given: the cheapest (threshold, margin floor) that keeps each
    task within its bound."""
    sels = {lad.selector for lad in ladders}
    rungs = {tuple(lad.rungs) for lad in ladders}
    if len(sels) > 1 or len(rungs) > 1:
        raise RarecacheError(f"the ladders differ in selector or rungs ({sels}, {rungs}): fit one policy per kind")
    names = [lad.task for lad in ladders]
    if len(set(names)) < len(names):
        raise RarecacheError(f"a task given twice: {', '.join(names)}")
    kinds = {lad.loss_kind for lad in ladders}
    if len(kinds) > 1:
        raise RarecacheError(f"the ladders were read with different losses ({', '.join(sorted(kinds))})")
    signals = {lad.signal for lad in ladders}
    if len(signals) > 1:
        raise RarecacheError(f"the ladders were read with different signals ({', '.join(sorted(signals))})")
    margins = all(lad.margin is not None for lad in ladders)
    measured = all(lad.run is not None for lad in ladders)  # exact climbing: the first rung is searched too
    groups = {lad.task: [Item(lad.js[k], lad.loss[k], lad.cost[k], lad.margin[k] if margins else None,
                              lad.js_plain[k] if measured else None, lad.run[k] if measured else None)
                         for k in range(len(lad.items))] for lad in ladders}
    bounds = {lad.task: (max_bpb if lad.metric == "bpb" else max_changed) for lad in ladders}
    levels = []  # the same fit at other loss bounds, for `serve --max-loss` (the bpb bound scales with the share)
    fits = fit_thresholds(groups, [{t: b * scale for t, b in bounds.items()} for scale in LEVELS], margins)
    th, floor, outcome, most, first = fits[LEVELS.index(1.0)]  # (one sweep for every level; 1.0: the bounds asked)
    for scale, ft in zip(LEVELS, fits):
        levels.append({"max_changed": max_changed * scale, "max_bpb": max_bpb * scale, "threshold": ft.threshold,
                       "min_margin": ft.min_margin, "max_rungs": ft.max_rungs,
                       **({"first_rung": ft.first_rung} if ft.first_rung else {}),
                       "tasks": {g: {k: ft.outcome[g][k] for k in ("loss", "cost", "work", "fallback")}
                                 for g in ft.outcome}})
    aucs = {lad.task: auc_ci(list(zip(lad.js, lad.changed))) for lad in ladders}
    strata = [k for k, lad in enumerate(ladders) for _ in lad.items]
    rows, changed = [r for lad in ladders for r in lad.rows], [c for lad in ladders for c in lad.changed]
    pooled = auc_ci([p for lad in ladders for p in zip(lad.js, lad.changed)], strata=strata)
    fitted = {"bounds": {"max_changed": max_changed, "max_bpb": max_bpb}, "loss": kinds.pop(), "levels": levels,
              "tasks": {lad.task: {"items": lad.items, "arm": lad.arm, "map_sha256": lad.map_sha256,
                                   **outcome[lad.task], "auc": aucs[lad.task][0], "auc_ci": list(aucs[lad.task][1:]),
                                   "signals": signal_aucs(lad.rows, lad.changed, lad.rungs)}
                        for lad in ladders},
              "auc_pooled": {"auc": pooled[0], "ci": list(pooled[1:])},  # every task's (item, rung) pairs together
              "signals": signal_aucs(rows, changed, list(next(iter(rungs))), strata)}  # every task pooled
    return GatePolicy(sels.pop(), rungs.pop(), th, floor, fitted, most, signals.pop(), first)


def evaluate(lad: Ladders, policy: GatePolicy) -> dict:
    """What `policy` does on a task's evaluated items (refused if it was fitted on any of them)."""
    fitted = policy.fitted.get("tasks", {}).get(lad.task, {})
    overlap = set(fitted.get("items", [])) & set(lad.items)
    if overlap:
        raise RarecacheError(f"{lad.task}: the policy was fitted on {len(overlap)} of these items "
                             f"({', '.join(sorted(overlap)[:3])} ...); evaluate on held-apart items")
    fitted_maps = {t.get("map_sha256") for t in policy.fitted.get("tasks", {}).values() if isinstance(t, dict)}
    if fitted_maps and fitted_maps != {lad.map_sha256}:
        raise RarecacheError(f"{lad.task}: the policy was fitted through another map than these ladders "
                             f"({', '.join(str(s)[:12] for s in fitted_maps)} vs {str(lad.map_sha256)[:12]})")
    if lad.signal != policy.signal:
        raise RarecacheError(f"{lad.task}: the ladders were read for signal {lad.signal}, the policy thresholds "
                             f"{policy.signal}")
    if policy.first_rung and lad.run is None:
        raise RarecacheError(f"{lad.task}: the policy starts at rung rho={policy.rungs[policy.first_rung]:g}, and "
                             "these ladders were recorded before rungs were direct handoffs (no `run`): record them "
                             "again")
    if lad.selector != policy.selector or tuple(lad.rungs) != policy.rungs:
        raise RarecacheError(f"{lad.task}: the ladder ({lad.selector}, rungs {lad.rungs}) is not the policy's "
                             f"({policy.selector}, rungs {list(policy.rungs)})")
    gated, cost, secs, fell, agree = [], [], [], 0, []
    for k_item, js in enumerate(lad.js):
        if policy.min_margin is not None and lad.margin is None:
            raise RarecacheError(f"{lad.task}: the policy floors the margin, which these ladders do not record")
        f = policy.first_rung
        seq = climbed_signals(js, f, lad.js_plain[k_item] if policy.signal == "js" else None)
        k = decide(seq, policy.threshold, lad.margin[k_item][f:] if lad.margin else None, policy.min_margin,
                   policy.max_rungs)
        k = None if k is None else f + k
        tm = lad.seconds[k_item]
        fixed = tm.get("map", 0.0) + tm.get("score", 0.0)
        climbed = list(tm.get("rung_recompute", []))  # rung 0 first
        if policy.signal == "js_views":  # the second view: its map, and one more last-position pass per rung
            fixed += tm.get("views_map", 0.0)
            climbed = [a + b for a, b in zip(climbed, tm.get("views_rungs", [0.0] * len(climbed)))]
        elif policy.signal == "nll":  # the LM head at each rung's recomputed positions
            measured = tm.get("rung_signals", [{}] * len(climbed))
            climbed = [a + (b or {}).get("nll", 0.0) for a, b in zip(climbed, measured)]
        if f and lad.run is not None and len(climbed) > f + 1 and lad.run[k_item][f] > 0:  # the first rung climbed
            climbed[f + 1] *= lad.cost[k_item][f] / lad.run[k_item][f]  # runs its whole set (seconds scale with it)
        spent = fixed + sum(climbed[:1])  # the map, the scores and rung 0 (plain transfer)
        if k is None:
            fell += 1
            agree.append(True)
            gated.append(lad.target[k_item])
            cost.append(1.0)
            m = rungs_climbed(len(js) - f, policy.max_rungs)
            spent = 0.0 if policy.always_falls_back else spent + sum(climbed[f + 1: f + 1 + m])
            secs.append(spent + tm.get("target_prefill", 0.0))
        else:
            agree.append(not lad.changed[k_item][k])
            gated.append(lad.value[k_item][k])
            cost.append(lad.cost[k_item][k])
            secs.append(spent + sum(climbed[f + 1: k + 2]))  # the rungs climbed, up to k
    bpb = lad.metric == "bpb"
    scale = 1.0 if bpb else 100.0  # pp for accuracy
    d, lo, hi, p = paired_diff_ci(gated, lad.target)
    exact = None if bpb else mcnemar(gated, lad.target)  # right/wrong: McNemar's exact p beside the bootstrap's
    prefill = [tm.get("target_prefill") for tm in lad.seconds]
    have = [(a, b) for a, b in zip(prefill, secs) if a]
    speedup = (sum(a for a, _ in have) / sum(b for _, b in have)) if have else None
    a, alo, ahi = auc_ci(list(zip(lad.js, lad.changed)))
    return {"unit": "bpb" if bpb else "pp", "delta": d * scale, "ci": [lo * scale, hi * scale], "p": p,
            "mcnemar_p": exact[0] if exact else None,
            "n": len(gated), "fallback_share": fell / len(gated), "mean_recomputed_share": float(np.mean(cost)),
            "expected_speedup": speedup, "target": float(np.mean(lad.target)), "gated": float(np.mean(gated)),
            "auc": a, "auc_ci": [alo, ahi], "agreement": float(np.mean(agree)),
            "signals": signal_aucs(lad.rows, lad.changed, lad.rungs)}


def oracle(lad: Ladders, cap: float, loss: str = "changed") -> dict:
    """The best any signal could do on these ladders: per item, the lowest rung up to ρ `cap` whose answer the
    target gives anyway (`loss` "changed": the same answer, bpb within CHANGED_BPB) or, with "accuracy", any rung
    no worse than the target (a change between two wrong answers, or an improvement, is free); fallback (cost
    1.0) where none is; bits per byte: "no worse" is at most CHANGED_BPB worse. With "changed" no policy that
    keeps every answer recomputes less on these rungs; one that accepts changes which offset each other could."""
    if loss not in LOSSES:
        raise RarecacheError(f"unknown gate loss {loss!r}: {', '.join(LOSSES)}")
    bpb = lad.metric == "bpb"

    def keeps(k: int, r: int) -> bool:
        if loss == "changed":
            return not lad.changed[k][r]
        worse = lad.value[k][r] - lad.target[k]  # bpb: higher is worse; accuracy: lower is worse
        return worse <= CHANGED_BPB if bpb else worse >= 0

    got, cost, accepted = [], [], dict.fromkeys((r for r in lad.rungs if r <= cap + 1e-9), 0)
    for k in range(len(lad.items)):
        rung = next((r for r, rho in enumerate(lad.rungs) if rho <= cap + 1e-9 and keeps(k, r)), None)
        got.append(lad.target[k] if rung is None else lad.value[k][rung])
        cost.append(1.0 if rung is None else lad.cost[k][rung])
        if rung is not None:
            accepted[lad.rungs[rung]] += 1
    scale = 1.0 if bpb else 100.0
    d, lo, hi, _ = paired_diff_ci(got, lad.target)
    return {"unit": "bpb" if bpb else "pp", "delta": d * scale, "ci": [lo * scale, hi * scale], "n": len(got),
            "fallback_share": 1 - sum(accepted.values()) / len(got), "mean_recomputed_share": float(np.mean(cost)),
            "accepted": accepted}


def markdown(results: dict[str, dict], policy: GatePolicy) -> str:
    floor = "" if policy.min_margin is None else f", margin >= {policy.min_margin:.3g} nats"
    floor += "" if policy.max_rungs is None else f", at most {policy.max_rungs} rung(s), then fallback"
    floor += "" if not policy.first_rung else f", from rung rho={policy.rungs[policy.first_rung]:g}"
    held = sum(len(t.get("items", [])) for t in policy.fitted.get("tasks", {}).values())
    loss = "accuracy lost" if policy.fitted.get("loss") == "accuracy" else "changed answers"
    lines = [f"gate: {policy.selector}, rungs {', '.join(f'{r:g}' for r in policy.rungs)}, "
             f"{policy.signal} threshold {policy.threshold:.4g} bits{floor} (fitted on {held} held-apart items, "
             f"multiple-choice loss: {loss})",
             "", "| task | n | target | gated | Δ gated − target (95% CI) | fell back | recomputed (fallback = 1) "
             "| expected speed-up | agreement | signal AUC (95% CI) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, r in results.items():
        pct = r["unit"] == "pp"
        f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:.4f}")
        u = " pp" if pct else ""
        dfmt = (lambda x: f"{x:+.1f}") if pct else (lambda x: f"{x:+.4f}")
        sp = f"{r['expected_speedup']:.2f}×" if r["expected_speedup"] else "—"
        auc = "—" if r["auc"] is None else f"{r['auc']:.3f} ({r['auc_ci'][0]:.3f}, {r['auc_ci'][1]:.3f})"
        mc = f"; McNemar p {format_p(r['mcnemar_p'], floor=False)}" if r.get("mcnemar_p") is not None else ""
        lines.append(f"| {task} | {r['n']} | {f(r['target'])} | {f(r['gated'])} | {dfmt(r['delta'])}{u} "
                     f"({dfmt(r['ci'][0])}, {dfmt(r['ci'][1])}{mc}) | {r['fallback_share']:.1%} | "
                     f"{r['mean_recomputed_share']:.3f} | {sp} | {_share(r.get('agreement'))} | {auc} |")
    pooled = policy.fitted.get("auc_pooled")
    if pooled:  # (policies fitted before it was recorded have none)
        lines += ["", f"signal AUC on the held-apart items, every task's (item, rung) pairs pooled: "
                      f"{pooled['auc']:.3f} (95% CI {pooled['ci'][0]:.3f}, {pooled['ci'][1]:.3f}; items resampled "
                      "within each task)"]
    return "\n".join(lines + _signal_table(results, policy.fitted.get("signals")))


def _share(x) -> str:
    return "—" if x is None else f"{x:.1%}"


def _signal_table(results: dict[str, dict], held: dict | None) -> list[str]:
    """Each signal's AUC for a changed answer (every rung pooled) per evaluated task, and on the held-apart
    items with every task pooled."""
    cols = [(t, r["signals"]["pooled"]) for t, r in results.items() if r.get("signals")]
    if held:
        cols.append(("held-apart, pooled", held["pooled"]))
    if not cols:
        return []
    names = list(dict.fromkeys(s for _, c in cols for s in c))
    cell = lambda c: "—" if c is None or c["auc"] is None else (  # noqa: E731
        f"{c['auc']:.3f} ({c['ci'][0]:.3f}, {c['ci'][1]:.3f})" if c["ci"][0] is not None else f"{c['auc']:.3f}")
    return ["", "signal AUC for a changed answer, every rung's pairs (95% CI, items resampled):", "",
            "| signal | " + " | ".join(t for t, _ in cols) + " |", "|---|" + "---|" * len(cols),
            *(f"| {s} | " + " | ".join(cell(c.get(s)) for _, c in cols) + " |" for s in names)]
