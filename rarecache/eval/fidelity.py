"""The fidelity summary: what a user of one map, selector and budget sees change against the target's own
answers, task by task, beside the map it would replace (`eval report FILES --fidelity-summary JSON --arm
RHO:SELECTOR --map-label L [--previous-label P] [--probe PROBE.json]`).

Per task: the target, the source alone and the handoff on the same items, the handoff's Δ against the
target (handoff − target: percentage points for accuracy, bits per byte for bpb) with its paired bootstrap
95% interval, and agreement, the share of items whose answer equals the target's own (null on bits per
byte, where a fixed text is scored and there is no answer to agree on; its Δ stands instead), with Cohen's
κ beside it (`answers.kappa`: agreement beyond what the answers' frequencies give by chance, so a map cannot
raise it by answering the target's favourite choice). Accuracy nets gains against losses; agreement does
not, which is why it is the figure an adoption rule reads. An exact tie between choices is an answer of its
own and agrees only with the same tie (answers.py). Right/wrong tasks add McNemar's exact p for the
handoff against the target (`mcnemar_p`); bits-per-byte tasks add the figures weighted by bytes, total bits
over total bytes, with the paired delta's interval (`by_bytes`): the mean of per-item ratios lets short
answers weigh as much as long ones (passage QA: +0.667 by the mean of ratios, +0.474 by bytes).

CoQA (`coqa_bpb`, issue 41's conversation workload) comes from an `eval drift run` file: the switching arm
at the same budget (`switch/RHO:SELECTOR`, a handoff at every target turn, no healing) against the target
reading the whole conversation itself, over the target's turns; the source is the 0.5B answering those same
turns alone, and the interval resamples stories (`drift.report`).

Every figure of a task is read over the items on which every arm it names has a record (target, source,
the handoff through the map and, given one, through the previous map), so the current and previous
columns are paired with each other as well as with the target. The schema is issue 41's.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RarecacheError
from ..registry import COQA_BPB
from .answers import PREDICTION, agreement, kappa
from .arms import handoff_arm
from .report import arm_name, format_p
from .results import map_sha256
from .significance import bytes_bpb, mcnemar, paired_bytes_ci, paired_diff_ci
from .summary import read_task


def one_sha(tasks: list[tuple[Path, object]], label: str) -> str:
    shas = {map_sha256(p, label) for p, _ in tasks}
    if None in shas:
        raise RarecacheError(f"map {label!r} is not recorded in every results file's meta (OUT.meta.json)")
    if len(shas) > 1:
        raise RarecacheError(f"map {label!r} is not the same file in every results file")
    return shas.pop()


def _task_cell(task, arm: str, items: list[str]) -> dict:
    """One task's figures for `arm` over `items` (every compared arm answered them)."""
    scale = 1.0 if task.metric == "bpb" else 100.0  # accuracy in percent, so delta is in pp
    vals = task.vals

    def mean(a: str) -> float:
        return scale * sum(vals[a][i] for i in items) / len(items)

    a, t = [vals[arm][i] for i in items], [vals["target"][i] for i in items]
    d, lo, hi, _ = paired_diff_ci(a, t)
    share, _ = agreement(task.rows, arm, task.metric, set(items))
    exact = mcnemar(a, t) if task.metric in PREDICTION else None  # right/wrong metrics only
    return {"metric": task.metric, "n": len(items), "target": mean("target"), "source": mean("source"),
            "handoff": mean(arm), "delta": scale * d, "ci": [scale * lo, scale * hi], "agreement": share,
            "kappa": kappa(task.rows, arm, task.metric, set(items)), "mcnemar_p": exact[0] if exact else None,
            "by_bytes": _by_bytes(task, arm, items)}


def _by_bytes(task, arm: str, items: list[str]) -> dict | None:
    """Bits per byte weighted by bytes (total bits over total bytes) for the target, the source and the
    handoff, and the handoff − target difference with its paired bootstrap interval; None unless the task
    scores bits per byte with the bytes recorded on every item."""
    if task.metric != "bpb":
        return None
    n_bytes = {r["item"]: r["bytes"] for r in task.rows if isinstance(r.get("bytes"), int)}
    if not all(i in n_bytes for i in items):
        return None
    w, vals = [n_bytes[i] for i in items], task.vals
    d, lo, hi = paired_bytes_ci([vals[arm][i] for i in items], [vals["target"][i] for i in items], w)
    return {**{k: bytes_bpb([vals[a][i] for i in items], w) for k, a in (("target", "target"),
                                                                          ("source", "source"), ("handoff", arm))},
            "delta": d, "ci": [lo, hi]}


def _probe(probe: Path, arm: str, label: str, previous: str | None, previous_arm: str | None = None) -> dict:
    """The probe's figures for `arm` (a name without map) through `label` and `previous_arm` (default
    `arm`) through `previous`, from the summary `eval probe` writes (eval/probe.py)."""
    try:
        arms = json.loads(probe.read_text())["arms"]
    except (OSError, ValueError, KeyError, TypeError):
        raise RarecacheError(f"--probe {probe}: not a probe summary (the .summary.json eval probe writes)") from None

    def cell(lab: str, name: str = arm) -> dict:
        got = arms.get(lab, {}).get(name) if isinstance(arms, dict) else None
        if not isinstance(got, dict):
            raise RarecacheError(f"--probe {probe}: no {name} through map {lab!r} (it has: "
                                 f"{', '.join(f'{k}/{a}' for k, v in arms.items() for a in v) or 'nothing'})")
        return got

    out = {"kl": cell(label)["kl"], "attn_cos": cell(label)["attn_cos"]}
    if previous is not None:
        out["previous_kl"] = cell(previous, previous_arm or arm)["kl"]
    return out


def _coqa_cell(drift: Path, spec: str, sha: str) -> dict:
    """coqa_bpb from a drift file whose switching arm `spec` ("RHO:SELECTOR") ran through the map `sha`."""
    from .drift import arm_figures, parse_arm, run_record

    run_record(drift, sha, "the summary's map goes")
    f = arm_figures(drift, parse_arm(spec)[0])
    return {"metric": "bpb", "n": f["n"], "stories": f["stories"], "target": f["target"], "source": f["source"],
            "handoff": f["gated"], "delta": f["delta"], "ci": f["ci"], "agreement": None, "kappa": None,
            "mcnemar_p": None, "by_bytes": None}  # (a drift file records no byte counts)


def fidelity_summary(paths: list[Path], spec: str, label: str, previous: str | None = None,
                     probe: Path | None = None, drift: Path | None = None,
                     previous_drift: Path | None = None, previous_spec: str | None = None) -> dict:
    """The summary of `paths` (one results file per task) for the handoff `spec` ("RHO:SELECTOR") through
    map `label`, and through `previous` beside it at `previous_spec` (default `spec`: a map adopted with a
    new default arm is compared with the old map as it was served); CoQA from the drift files through each."""
    previous_spec = previous_spec or spec
    arm = handoff_arm(spec, label)
    before = handoff_arm(previous_spec, previous) if previous is not None else None
    tasks = [(p, read_task(p)) for p in paths]
    names = [t.name for _, t in tasks]
    if len(set(names)) < len(names):
        raise RarecacheError(f"a task given twice: {', '.join(names)}")
    cur: dict[str, dict] = {}
    prev: dict[str, dict] = {}
    for path, task in tasks:
        needed = ["target", "source", arm.name] + ([before.name] if before else [])
        missing = [a for a in needed if a not in task.vals]
        if missing:
            raise RarecacheError(f"{path}: no {', '.join(missing)} arm (the fidelity summary compares "
                                 f"{', '.join(needed)} on the same items)")
        items = sorted(set.intersection(*(set(task.vals[a]) for a in needed)))
        if not items:
            raise RarecacheError(f"{path}: no item has every arm of {', '.join(needed)}")
        cur[task.name] = _task_cell(task, arm.name, items)
        if before:
            prev[task.name] = _task_cell(task, before.name, items)
    out = {"map": one_sha(tasks, label), "selector": arm.method, "rho": arm.rho, "tasks": cur}
    if drift is not None:
        cur[COQA_BPB] = _coqa_cell(drift, spec, out["map"])
    if before:
        out["previous"] = {"map": one_sha(tasks, previous), "selector": before.method, "rho": before.rho,
                           "tasks": prev}
        if previous_drift is not None:
            prev[COQA_BPB] = _coqa_cell(previous_drift, previous_spec, out["previous"]["map"])
    elif previous_drift is not None:
        raise RarecacheError("--previous-drift needs --previous-label")
    if previous_drift is not None and drift is None:
        raise RarecacheError("--previous-drift needs --drift (the table compares the two maps' CoQA)")
    if probe is not None:
        out["probe"] = _probe(probe, arm_name(arm.rho, arm.method), label, previous,
                              arm_name(before.rho, before.method) if before else None)
    return out


def markdown(summary: dict, label: str, previous: str | None = None) -> str:
    """The summary as a table: per task the map's and (given) the previous map's figures. Maps are named with
    their sha256 prefix; the delta cell adds McNemar's exact p on right/wrong tasks and the byte-weighted
    delta on bits per byte."""
    was = summary.get("previous", {})
    if previous:
        previous = f"{previous}[{str(was.get('map'))[:8]}]"
        if (was.get("selector"), was.get("rho")) != (summary["selector"], summary["rho"]):
            previous = f"{previous} ({was['selector']} {was['rho']:g})"
    lines = [f"fidelity through map {label}[{summary['map'][:8]}] (sha256 {summary['map'][:12]}), {summary['selector']} at "
             f"rho {summary['rho']:g}; delta = handoff - target (pp for accuracy, bpb for bits per byte; beside it "
             "McNemar's exact p, or on bits per byte the delta weighted by bytes), agreement = share of answers "
             "equal to the target's, a tie agreeing only with the same tie (— on bits per byte)", "",
             "| task | n | target | source | handoff | delta (95% CI) | agreement |"
             + (f" {previous}: handoff | delta (95% CI) | agreement |" if previous else ""),
             "|---" * (7 + (3 if previous else 0)) + "|"]

    def cells(t: dict | None) -> list[str]:
        if t is None:
            return ["—", "—", "—"]
        f = "{:.4f}" if t["metric"] == "bpb" else "{:.1f}"
        fd = "{:+.4f}" if t["metric"] == "bpb" else "{:+.1f}"
        ag = "—" if t["agreement"] is None else f"{t['agreement']:.0%}" + (
            f" (κ {t['kappa']:.2f})" if t.get("kappa") is not None else "")
        extra = ""
        if t.get("mcnemar_p") is not None:
            extra = f"; McNemar p {format_p(t['mcnemar_p'], floor=False)}"
        elif t.get("by_bytes"):
            b = t["by_bytes"]
            extra = f"; by bytes {fd.format(b['delta'])} ({fd.format(b['ci'][0])}, {fd.format(b['ci'][1])})"
        return [f.format(t["handoff"]),
                f"{fd.format(t['delta'])} ({fd.format(t['ci'][0])}, {fd.format(t['ci'][1])}{extra})", ag]

    for name, t in summary["tasks"].items():
        f = "{:.4f}" if t["metric"] == "bpb" else "{:.1f}"
        source = "—" if t["source"] is None else f.format(t["source"])
        row = [name, str(t["n"]), f.format(t["target"]), source, *cells(t)]
        if previous:
            row += cells(summary["previous"]["tasks"].get(name))
        lines.append("| " + " | ".join(row) + " |")
    if "probe" in summary:
        p = summary["probe"]
        lines += ["", f"probe: mean KL {p['kl']:.4f} bits, attention-output cosine {p['attn_cos']:.4f}"
                  + (f"; previous map's KL {p['previous_kl']:.4f}" if "previous_kl" in p else "")]
    return "\n".join(lines)
