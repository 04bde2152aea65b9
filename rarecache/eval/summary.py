"""The general map's summary over several tasks' results: which selector to default to, and what it
and plain transfer keep on each task (`eval report FILES --general-summary PATH`).

The default selector is chosen by the numbers, not by a person: among the deployable selectors
run at every budget of `RHOS` on every task, the one with the highest mean share of the
source-to-target gap kept, (arm − source) / (target − source), over tasks and budgets. Not the
mean share of the plain-transfer gap closed (the issue's headline figure, also recorded): where
plain transfer is already near the target (ARC-Challenge: 2 pp at n = 100) that share divides
noise by a near-zero gap, reaches ±150%, and one task's noise would pick the default. The
source-to-target gap is wider (v1 at n = 100: 6-20 pp, 0.09 bpb) and the same for every selector, so
each task weighs the same in every candidate's mean, and within a task the ranking is the arms'
own. It is still a ratio of noisy means: at ARC-C's 6 pp (p = 0.26 at n = 100) one item moves a
selector's share there by 17%, against 50% for gap closed. A task whose target does not beat its
source is refused. The summary file records both means per candidate, so the choice can be checked.
The pick is made on the very results its figures are then read from, so they are the best of the
candidates' and lean its way: the summary labels it so (`default_picked`, and the table's first line).

Arms may have run on different numbers of items (a queue grows the arms the acceptance reads first).
The candidates are compared on the items every one of them, the target and the source share in each
task (`pick_n`); each headline figure is read over the items its own arms share, paired, and records
that n (`n`: the default at ρ 0.2 against the target and plain transfer; `n_plain_minus_source`) and
its paired bootstrap 95% interval (`gap_closed_ci`, `plain_minus_source_ci`): at n = 100 HellaSwag's
gap closed read 73%, at n = 300 112%. On bits per byte, `plain_minus_source_by_bytes` gives the same
difference weighted by bytes (total bits over total bytes; metrics.bytes_bpb).

A map file serves plain transfer through its plain view (`Mapper.plain`) and handoffs through its
fit. Results may have measured the two through two files (`--plain-label`: the sharpened fit's
plain transfer, `--map-label`: the ridge fit's handoffs); `--served-map` then names the one file
that serves both, and the summary stands for it only after checking, in code, that its fit is the
handoff map's tensors bit for bit and its plain view the plain map's to float32 rounding.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from ..errors import RarecacheError
from ..registry import RANK
from ..transfer.handoff import LAYER_PREFIX
from .report import arm_name, is_oracle, split_arm, summarise
from .results import load_results, map_sha256, sibling
from .significance import gap_closed_ci, paired_bytes_ci, paired_diff_ci

RHOS = (0.1, 0.2, 0.3)


PLAIN_VIEW_RTOL = 1e-5  # a served map's plain view against the plain-transfer map: float32 rounding apart


class _Task(NamedTuple):
    """One results file as read: its task, metric, chance level, rows, and per arm its values by item."""
    name: str
    metric: str
    chance: float | None
    rows: list[dict]
    vals: dict[str, dict[str, float]]


def read_task(path: Path) -> _Task:
    """One results file as read (`_Task`), its metric the task's headline one."""
    from .tasks import TASKS
    from .tasks.custom import headline

    rows = load_results(path)
    if not rows:
        raise RarecacheError(f"{path} holds no results yet")
    name = rows[0]["task"]
    metric, chance = (TASKS[name].metric, TASKS[name].chance) if name in TASKS else headline(rows)
    vals: dict[str, dict[str, float]] = {}
    for r in rows:
        if metric in r:
            vals.setdefault(r["arm"], {})[r["item"]] = float(r[metric])
    return _Task(name, metric, chance, rows, vals)


def _candidates(vals: dict[str, dict[str, float]], label: str) -> set[str]:
    """The deployable selectors one task ran at every budget of RHOS through map `label`."""
    rhos: dict[str, set[float]] = {}
    for arm in vals:
        parts = split_arm(arm)
        if parts is not None and parts[2] == label:
            rhos.setdefault(parts[1], set()).add(parts[0])
    return {s for s, got in rhos.items() if not is_oracle(s) and s != LAYER_PREFIX and set(RHOS) <= got}


def _task_summary(task: _Task, label: str, candidates: set[str], plain_label: str | None = None
                  ) -> tuple[str, str, dict[str, dict], dict[str, dict[str, float]], int]:
    """Task name, metric, per arm the summary over the items the candidates are compared on, per arm its
    values by item, and the number of those items."""
    shared = _pick_items(task.vals, label, candidates)
    picked = [r for r in task.rows if r["item"] in shared]
    summary = summarise(picked, task.metric, task.chance, lower_is_better=task.metric == "bpb",
                        plain_label=plain_label)
    return task.name, task.metric, {r["arm"]: r for r in summary}, task.vals, len(shared)


def _pick_items(vals: dict[str, dict[str, float]], label: str, candidates: set[str]) -> set[str]:
    """The items the target, the source and every candidate selector (run at every budget on every task,
    through `label`) share at every budget: where the candidates are compared. A selector a task ran at
    every budget on fewer items, but that another task lacks, is not a candidate and narrows nothing."""
    arms = ["target", "source"] + [arm_name(r, s, label) for s in sorted(candidates) for r in RHOS]
    items = [set(vals[a]) for a in arms if a in vals]
    return set.intersection(*items) if items else set()


def _paired(a: dict[str, float], b: dict[str, float]) -> tuple[float | None, list[float] | None, int]:
    """Mean of a - b over the items both hold, its paired bootstrap 95% interval, and how many."""
    both = sorted(set(a) & set(b))
    if not both:
        return None, None, 0
    m, lo, hi, _ = paired_diff_ci([a[i] for i in both], [b[i] for i in both])
    return m, [lo, hi], len(both)


def general_summary(paths: list[Path], label: str | None = None, plain_label: str | None = None,
                    served: Path | None = None) -> dict:
    """The summary of `paths` (one results file per task) through map `label` (its handoffs) and
    `plain_label` (its plain transfer; default: `label`), standing for the map file `served` when given
    (checked: `check_served`)."""
    if label is None:
        labels = {split_arm(a)[2] for p in paths for a in {r["arm"] for r in load_results(p)}
                  if split_arm(a) is not None}
        if len(labels) != 1:
            raise RarecacheError(f"the results go through several maps ({', '.join(sorted(labels))}): "
                                 "name one with --map-label")
        label = labels.pop()
    loaded = [read_task(p) for p in paths]
    rows_of = {t.name: t.rows for t in loaded}
    names = [t.name for t in loaded]
    if len(set(names)) < len(names):
        raise RarecacheError(f"a task given twice: {', '.join(names)}")
    selectors = set.intersection(*(_candidates(t.vals, label) for t in loaded)) if loaded else set()
    tasks = [(p, *_task_summary(t, label, selectors, plain_label)) for p, t in zip(paths, loaded)]
    for _, name, metric, arms, _, _ in tasks:  # the rule's denominator: the target must beat the source
        t, src = arms.get("target"), arms.get("source")
        if t is None or src is None:
            raise RarecacheError(f"{name}: no {'target' if t is None else 'source'} arm: the share of the "
                                 "source-to-target gap a selector keeps needs both")
        if (t["mean"] >= src["mean"]) if metric == "bpb" else (t["mean"] <= src["mean"]):
            raise RarecacheError(f"{name}: the target ({t['mean']:.4g}) is not better than the source "
                                 f"({src['mean']:.4g}): there is no gap for a selector to keep")
    means, closed = {}, {}
    for sel in sorted(selectors):
        cells = [arms.get(arm_name(r, sel, label), {}) for _, _, _, arms, _, _ in tasks for r in RHOS]
        kept = [c.get("model_gap_kept") for c in cells]
        if kept and all(k is not None for k in kept):
            means[sel] = sum(kept) / len(kept)
            gaps = [c.get("gap_closed") for c in cells]
            closed[sel] = sum(gaps) / len(gaps) if all(g is not None for g in gaps) else None
    if not means:
        raise RarecacheError(f"no deployable selector was run at rho {', '.join(map(str, RHOS))} on every task "
                             f"through map {label!r}")
    default = max(means, key=means.get)
    plain_label = plain_label or label
    for _, name, _, _, vals, _ in tasks:
        if arm_name(0, RANK, plain_label) not in vals:
            raise RarecacheError(f"{name}: no plain-transfer arm {arm_name(0, RANK, plain_label)} (map label "
                                 f"{plain_label!r}): plain_minus_source and gap closed read it")
    sha, plain_sha = _one_sha(paths, label), _one_sha(paths, plain_label)
    out = {"map": sha, "map_label": label, "default_selector": default,
           # the default is the best of the candidates on these very results: its figures favour it
           "default_picked": f"after the fact, on these results: the highest mean of {len(means)} candidates",
           "selector_mean_model_gap_kept": means, "selector_mean_gap_closed": closed, "tasks": {}}
    if plain_label != label:
        out.update(plain_label=plain_label, plain_map=plain_sha)
    if served is not None:
        out["served"] = check_served(served, paths[0], label, plain_label)
        out["fit_map"], out["map"] = sha, out["served"]["sha256"]  # (the label's file; the one served)
    for _, name, metric, arms, vals, pick_n in tasks:
        bpb = metric == "bpb"
        plain, source = vals.get(arm_name(0, RANK, plain_label), {}), vals.get("source", {})
        d, d_ci, n_d = _paired(source, plain) if bpb else _paired(plain, source)  # >= 0: plain at least as good
        if d is not None and not bpb:
            d, d_ci = d * 100, [x * 100 for x in d_ci]
        by_bytes = _bytes_gap(rows_of[name], source, plain) if bpb else None
        target, arm = vals.get("target", {}), vals.get(arm_name(0.2, default, label), {})
        both = sorted(set(target) & set(plain) & set(arm))  # the default at 0.2, paired with both ends of its gap
        closed = closed_ci = None
        if both:
            g, lo, hi = gap_closed_ci(*([v[i] for i in both] for v in (target, plain, arm)))
            if not math.isnan(g):  # (nan: the target and plain transfer level, no gap to close)
                closed, closed_ci = g + 0.0, [lo, hi]
        out["tasks"][name] = {"gap_closed_default_rho0.2": closed, "gap_closed_ci": closed_ci,
                              "plain_minus_source": d, "plain_minus_source_ci": d_ci,
                              "unit": "bpb" if bpb else "pp", "metric": metric, "n": len(both),
                              "n_plain_minus_source": n_d, "pick_n": pick_n,
                              # the share of answers equal to the target's (None on bits per byte: no answer)
                              "agreement_default_rho0.2": arms.get(arm_name(0.2, default, label), {}).get("agreement"),
                              "agreement_plain": arms.get(arm_name(0, RANK, plain_label), {}).get("agreement")}
        if bpb:  # the same difference weighted by bytes (total bits over total bytes; None: bytes not recorded)
            out["tasks"][name]["plain_minus_source_by_bytes"] = by_bytes
    return out


def _bytes_gap(rows: list[dict], source: dict[str, float], plain: dict[str, float]) -> dict | None:
    """source − plain transfer in bits per byte weighted by bytes over the items both hold, with its paired
    bootstrap 95% interval; None unless every such item records its bytes."""
    n_bytes = {r["item"]: r["bytes"] for r in rows if isinstance(r.get("bytes"), int)}
    both = sorted(set(source) & set(plain))
    if not both or not all(i in n_bytes for i in both):
        return None
    d, lo, hi = paired_bytes_ci([source[i] for i in both], [plain[i] for i in both], [n_bytes[i] for i in both])
    return {"delta": d, "ci": [lo, hi], "n": len(both)}


def _one_sha(paths: list[Path], label: str) -> str | None:
    shas = {map_sha256(p, label) for p in paths}
    if len(shas) > 1:
        raise RarecacheError(f"map {label!r} is not the same file in every results file")
    return shas.pop()


def _map_of(results: Path, label: str):
    """The map file labelled `label` in `results`' meta, loaded, after checking it is the recorded file."""
    import json

    from ..packages import sha256_file
    from ..transfer.mapper import Mapper

    entry = json.loads(sibling(results, ".meta.json").read_text()).get("maps", {}).get(label)
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not Path(entry["file"]).is_file():
        raise RarecacheError(f"--served-map: {results} does not name an existing file for map {label!r} (the "
                             "check compares the served map with the very files the results went through)")
    if sha256_file(Path(entry["file"])) != entry.get("sha256"):
        raise RarecacheError(f"--served-map: {entry['file']} is not the map {label!r} of {results} (sha256 differs)")
    return Mapper.load(entry["file"]), entry["sha256"]


def check_served(served: Path, results: Path, label: str, plain_label: str) -> dict:
    """What a summary measured through `label` (handoffs) and `plain_label` (plain transfer) holds for the
    map file `served` when its fit is `label`'s map bit for bit and its plain view is `plain_label`'s
    plain view to float32 rounding (PLAIN_VIEW_RTOL); else a clear error. Returns the record."""
    import torch

    from ..packages import sha256_file
    from dataclasses import fields

    from ..transfer.sidefit import SideFit
    from ..transfer.mapper import SIDES, Mapper

    mine, (fit, fit_sha), (plain, plain_sha) = Mapper.load(served), _map_of(results, label), _map_of(results,
                                                                                                      plain_label)
    names = [f.name for f in fields(SideFit)]
    if mine.mlp or fit.mlp or not all(torch.equal(getattr(mine.sides[s], n), getattr(fit.sides[s], n))
                                      for s in SIDES for n in names):
        raise RarecacheError(f"--served-map: {served}'s tensors are not map {label!r}'s: its handoffs were not "
                             "measured")
    if plain.mlp or plain.info.k != mine.info.k or (plain.info.source, plain.info.target) != (
            mine.info.source, mine.info.target):
        raise RarecacheError(f"--served-map: {served} and map {plain_label!r} differ in models, k or kind")
    worst = 0.0
    a, b = mine.plain(), plain.plain()
    if not all(torch.equal(a.sides[s].sources, b.sides[s].sources) for s in SIDES):
        raise RarecacheError(f"--served-map: {served} reads other source layers than map {plain_label!r}")
    for s in SIDES:
        for n in ("weight", "bias"):
            x, y = getattr(a.sides[s], n).double(), getattr(b.sides[s], n).double()
            worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item())
    if worst > PLAIN_VIEW_RTOL:
        raise RarecacheError(f"--served-map: {served}'s plain-transfer view is not map {plain_label!r}'s (largest "
                             f"difference {worst:.2g} of the largest entry): its plain transfer was not measured")
    return {"file": served.name, "sha256": sha256_file(served), "fit_equals": {"label": label, "sha256": fit_sha},
            "plain_view_equals": {"label": plain_label, "sha256": plain_sha, "max_relative_difference": worst}}


def markdown(summary: dict) -> str:
    closed = summary["selector_mean_gap_closed"]
    def tag(label: str, sha: str | None) -> str:
        return f"{label}[{sha[:8] if sha else 'unrecorded'}]"

    via = tag(summary["map_label"], summary.get("fit_map", summary["map"])) + (
        f" (plain transfer through {tag(summary['plain_label'], summary.get('plain_map'))})"
        if summary.get("plain_label") else "")
    if summary.get("served"):
        via += f", served as {summary['served']['file']} (sha256 {summary['served']['sha256'][:12]}, checked)"
    lines = [f"default selector through map {via}: {summary['default_selector']}, picked after the fact on these "
             f"results (the best of {len(summary['selector_mean_model_gap_kept'])}: its figures below favour it; "
             f"mean share of the source-to-target gap kept over tasks at rho {', '.join(map(str, RHOS))}; "
             "in brackets the mean share of the plain-transfer gap closed: "
             + ", ".join(f"{k} {v:.1%} [" + ("—" if closed.get(k) is None else f"{closed[k]:.1%}") + "]"
                         for k, v in sorted(summary["selector_mean_model_gap_kept"].items(), key=lambda kv: -kv[1]))
             + ")",
             "", "| task | gap closed, default at ρ = 0.2 (95% CI; n) | plain transfer − source alone (95% CI; n) | "
             "selectors compared on (n) |", "|---|---|---|---|"]
    for name, t in summary["tasks"].items():
        g, gci, d, dci = (t["gap_closed_default_rho0.2"], t.get("gap_closed_ci"), t["plain_minus_source"],
                          t.get("plain_minus_source_ci"))
        num = "{:+.1f}".format if t["unit"] == "pp" else "{:+.4f}".format
        g = "—" if g is None else f"{g:.1%} (" + (f"{gci[0]:.0%} to {gci[1]:.0%}; " if gci else "")
        d = "—" if d is None else f"{num(d)} {t['unit']} (" + (f"{num(dci[0])}, {num(dci[1])}; " if dci else "")
        lines.append(f"| {name} | {g}{t['n']}) | {d}{t.get('n_plain_minus_source', t['n'])}) | "
                     f"{t.get('pick_n', t['n'])} |")
    return "\n".join(lines)
