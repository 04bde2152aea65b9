"""The long-context suite's summary at the served handoff, from committed records (`rarecache eval
longctx-summary RESULTS... --bench BENCH`; issue 54's `docs/artifacts/longctx-summary.json`).

Per task and length (`<task>@<T>`, T as each row records it), over the items on which the target (the 1.5B
alone), the source (the 0.5B alone) and the served handoff all have a row: each arm's mean of the task's metric
as a fraction 0-1 (`correct`: the exact value found; `f1`), agreement, the share of those items whose answer
(the normalised answer each row records as `prediction`) equals the target's own answer on the same item, read
from the target arm's rows of the same file as every report reads it (`report.agreement`), and
delta = served − target with its paired bootstrap 95% interval (`metrics.paired_diff_ci`).

`speedup_T2048`: the served handoff against the target's own prefill at T 2048 and batch 1, read from a bench
file (`rarecache bench handoff --out`: a JSON object with rows; or JSON lines, one row or one such object a
line) at the served budget and selector. A missing task, length, arm or bench row is refused by name, as is a
served map that is not the same file in every results file (their meta records its sha256).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RarecacheError
from .arms import handoff_arm
from .fidelity import one_sha
from .significance import paired_diff_ci
from .report import agreement
from .summary import read_task
from .tasks import LONG_CONTEXT

BENCH_T = 2048
# what the acceptance reads: every task at 2048; retrieval and multi-document QA at 4096 too
REQUIRED = tuple(f"{t}@{BENCH_T}" for t in LONG_CONTEXT) + ("retrieval@4096", "multidoc_qa@4096")


def _cell(task, arm: str, items: list[str]) -> dict:
    vals = task.vals

    def mean(a: str) -> float:
        return sum(vals[a][i] for i in items) / len(items)

    d, lo, hi, _ = paired_diff_ci([vals[arm][i] for i in items], [vals["target"][i] for i in items])
    share, _ = agreement(task.rows, arm, task.metric, set(items))
    return {"n": len(items), "metric": task.metric, "target": mean("target"), "source": mean("source"),
            "served": mean(arm), "agreement": share, "delta": d, "ci": [lo, hi]}


def task_key(path: Path, task) -> str:
    """`<task>@<T>` of a results file of one long-context task at one length."""
    if task.name not in LONG_CONTEXT:
        raise RarecacheError(f"{path}: task {task.name} is not a long-context task ({', '.join(LONG_CONTEXT)})")
    lengths = {r.get("length") for r in task.rows}
    if len(lengths) != 1 or None in lengths:
        raise RarecacheError(f"{path}: its rows are not of one length (lengths {sorted(map(str, lengths))}); "
                             "each results file holds one task at one --length")
    return f"{task.name}@{lengths.pop()}"


def bench_speedup(path: Path, rho: float, selector: str, length: int = BENCH_T) -> tuple[float, dict]:
    """The speed-up of the handoff at `rho` and `selector`, batch 1, length `length`, in a bench file; and the
    setup it was timed in (dtype, CPU capability, device, as the file records them)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise RarecacheError(f"cannot read bench file {path}: {e.strerror or e}") from None
    try:
        objects = [json.loads(text)]
    except ValueError:
        try:
            objects = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            raise RarecacheError(f"{path} is not a bench file (a JSON object with rows, or JSON lines)") from None
    rows = []
    for o in objects:
        if isinstance(o, dict) and isinstance(o.get("rows"), list):
            head = {k: v for k, v in o.items() if k != "rows"}
            rows += [{**head, **r} for r in o["rows"] if isinstance(r, dict)]
        elif isinstance(o, dict):
            rows.append(o)
    found = [r for r in rows if r.get("T") == length and r.get("batch", 1) == 1 and "speedup" in r
             and isinstance(r.get("rho"), (int, float)) and abs(r["rho"] - rho) < 1e-9
             and r.get("selector", selector) == selector]
    if len(found) != 1:
        raise RarecacheError(f"{path}: {len(found)} rows time the {selector} handoff at rho {rho:g}, T {length}, "
                             f"batch 1 (need exactly one; run rarecache bench handoff --lengths {length} --rhos "
                             f"{rho:g} --batches 1 --selector {selector} --out FILE)")
    r = found[0]
    return float(r["speedup"]), {k: r.get(k) for k in ("dtype", "cpu", "device", "selector") if k in r}


def longctx_summary(paths: list[Path], spec: str, label: str | None, bench: Path, partial: bool = False) -> dict:
    """The summary of `paths` (one results file per task and length) for the served handoff `spec`
    ("RHO:SELECTOR") through map `label` (None: the one map every file records), with the speed-up at T 2048
    from `bench`. `partial`: write what there is and list what is missing, instead of refusing."""
    tasks = [(p, read_task(p)) for p in paths]
    label = _label(paths) if label is None else label
    arm = handoff_arm(spec, label)
    cells: dict[str, dict] = {}
    for path, task in tasks:
        key = task_key(path, task)
        if key in cells:
            raise RarecacheError(f"{key} given twice ({path})")
        needed = ["target", "source", arm.name]
        missing = [a for a in needed if a not in task.vals]
        if missing:
            raise RarecacheError(f"{path}: no {', '.join(missing)} arm (the summary compares {', '.join(needed)} "
                                 "on the same items)")
        items = sorted(set.intersection(*(set(task.vals[a]) for a in needed)))
        if not items:
            raise RarecacheError(f"{path}: no item has every arm of {', '.join(needed)}")
        cells[key] = _cell(task, arm.name, items)
    absent = [k for k in REQUIRED if k not in cells]
    if absent and not partial:
        raise RarecacheError(f"no records for {', '.join(absent)} (the summary needs every task at {BENCH_T} and "
                             "retrieval and multidoc_qa at 4096; --partial writes what there is)")
    speedup, setup = bench_speedup(bench, arm.rho, arm.method)
    out = {"served": {"selector": arm.method, "rho": arm.rho, "map_sha256": one_sha(tasks, label)},
           "speedup_T2048": speedup, "bench": {"file": bench.name, **setup},
           "tasks": dict(sorted(cells.items(), key=lambda kv: (LONG_CONTEXT.index(kv[0].split("@")[0]),
                                                               int(kv[0].split("@")[1]))))}
    if absent:
        out["missing"] = absent
    return out


def _label(paths: list[Path]) -> str:
    """The map label every results file records, when each records exactly one."""
    from .results import sibling

    labels = set()
    for p in paths:
        meta = sibling(p, ".meta.json")
        maps = json.loads(meta.read_text()).get("maps", {}) if meta.is_file() else {}
        if len(maps) != 1:
            raise RarecacheError(f"{p}: its meta records {len(maps)} maps; name the served one with --map-label")
        labels |= set(maps)
    if len(labels) != 1:
        raise RarecacheError(f"the results files record maps {', '.join(sorted(labels))}; name one with --map-label")
    return labels.pop()


def markdown(summary: dict) -> str:
    s = summary["served"]
    lines = [f"long-context suite: {s['selector']} at rho {s['rho']:g} through map {s['map_sha256'][:12]}; speed-up "
             f"at T {BENCH_T}: {summary['speedup_T2048']:.2f}x; delta = served - target; agreement = share of answers "
             "equal to the target's", "",
             "| task@T | n | metric | target | source | served | delta (95% CI) | agreement |", "|---" * 8 + "|"]
    for key, t in summary["tasks"].items():
        ag = "—" if t["agreement"] is None else f"{t['agreement']:.0%}"
        lines.append(f"| {key} | {t['n']} | {t['metric']} | {t['target']:.3f} | {t['source']:.3f} | {t['served']:.3f} "
                     f"| {t['delta']:+.3f} ({t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}) | {ag} |")
    if summary.get("missing"):
        lines += ["", f"missing: {', '.join(summary['missing'])}"]
    return "\n".join(lines)
