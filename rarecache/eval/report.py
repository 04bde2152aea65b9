"""Summaries of a results file: the metric per arm with bootstrap intervals, retention against the
target, floor-normalised retention, the share of the plain-transfer gap closed, paired tests against
the target and between selectors, agreement (the share of items whose answer is the target's own: what
a user sees change, which accuracy nets out; none on bits per byte, where the paired Δ stands) with its
chance-corrected form (Cohen's κ: agreement that answering the target's favourite choice cannot buy), where the
recompute budget went, and on multiple choice the answer an
arm gives most often: near chance, accuracy can be only the share of gold answers at the choice a model
favours (RESULTS.md 8.3: the 0.5B answers MMLU's B on 84% of items), which the mean alone hides.

A ratio with nothing to divide by (no gap to close, a target not above chance) is
undefined and prints as —. A p-value prints with the number of paired items it rests
on, and at the bootstrap's floor as a bound ("< 0.0001"): with no resample on the other
side of zero, the bootstrap can say no more. On right/wrong outcomes the exact McNemar p
(metrics.mcnemar) stands beside it, with the discordant items it counts.

What could mislead is printed beside the figures it would move: multiple-choice ties (answers.py: a tie is
its own answer, agreeing only with the same tie), generations cut at the length cap (`truncated`), and on
bits per byte the byte-weighted figure (total bits over total bytes) beside the mean of per-item ratios.
Handoff arms carry their map's sha256 prefix where the results' record names it (`display`), so a label
such as v4 cannot stand for two files.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..registry import RANK
from ..transfer.selectors import SELECTORS
from .answers import PREDICTION, agreement, kappa, ties
from .answers import agrees, answer_field  # noqa: F401  (research scripts read them from here)
from .significance import bytes_bpb, mcnemar, mean_ci, p_floor, paired_bytes_ci, paired_diff_ci

GAP_CLOSED = "gap closed (of target − plain transfer, same map)"  # the column's header says what it divides by
GAP_KEPT = "kept (of target − source)"  # the default selector's rule (eval/summary.py)


def gap_closed_header(plain_label: str | None = None) -> str:
    return GAP_CLOSED if plain_label is None else f"gap closed (of target − plain transfer through {plain_label})"


def split_arm(arm: str) -> tuple[float, str, str] | None:
    """"rho=0.3/rank@wiki" -> (0.3, "rank", "wiki"); None for target / source."""
    if not arm.startswith("rho="):
        return None
    body, _, label = arm.partition("@")
    rho, _, selector = body[4:].partition("/")
    return float(rho), selector, label


def is_oracle(selector: str) -> bool:
    sel = SELECTORS.get(selector)
    return sel is not None and sel.oracle


def map_tag(label: str, shas: dict[str, str] | None) -> str:
    """A map label as printed: with the first 8 hex digits of its file's sha256 ("v4[7145adb2]") when `shas`
    (label -> sha256, the results' record) is given, "[unrecorded]" where the record lacks the label."""
    if shas is None:
        return label
    sha = shas.get(label)
    return f"{label}[{sha[:8] if isinstance(sha, str) else 'unrecorded'}]"


def display(arm: str, shas: dict[str, str] | None = None) -> str:
    """An arm's name as printed: its map with the map's sha256 prefix (`map_tag`, given `shas`), and oracles
    (which read the target's own prefill) say so. The name in the records stays as it was."""
    parts = split_arm(arm)
    if parts is None:
        return arm
    body, at, label = arm.partition("@")
    name = body + at + map_tag(label, shas) if shas is not None else arm
    return name + (" (oracle)" if is_oracle(parts[1]) else "")


def arm_name(rho: float, selector: str, label: str = "") -> str:
    return f"rho={rho:g}/{selector}" + (f"@{label}" if label else "")


def _mean_over(vals: dict[str, float], items: list[str]) -> float:
    return sum(vals[i] for i in items) / len(items)


def summarise(rows: list[dict], metric: str = "correct", chance: float = 0.0,
              lower_is_better: bool = False, plain_label: str | None = None) -> list[dict]:
    """Per arm: mean and CI, against the target, the share of the plain-transfer gap closed (plain transfer
    through the same map, or through `plain_label`'s when given), of the source-to-target gap kept, and
    against rank disagreement at the same budget."""
    by_arm: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if metric in r:
            by_arm[r["arm"]][r["item"]] = float(r[metric])
    target = by_arm.get("target", {})
    byte_counts = {r["item"]: r["bytes"] for r in rows if metric == "bpb" and isinstance(r.get("bytes"), int)}
    out = []
    for arm, vals in by_arm.items():
        items = sorted(vals)
        m, lo, hi = mean_ci([vals[i] for i in items])
        row = {"arm": arm, "n": len(items), "mean": m, "lo": lo, "hi": hi,
               "position0": _share(rows, arm, "position0"), "template_share": _template_share(rows, arm),
               "top_answer": top_answer(rows, arm, metric), "ties": ties(rows, arm, metric),
               "truncated": truncated(rows, arm)}
        weighted = [i for i in items if i in byte_counts]
        if weighted:  # bits per byte over the arm's text as a whole, beside the mean of per-item ratios
            row["bytes_mean"] = bytes_bpb([vals[i] for i in weighted], [byte_counts[i] for i in weighted])
        shared = [i for i in items if i in target]
        if target and arm != "target" and shared:
            t, a = _mean_over(target, shared), _mean_over(vals, shared)
            if not lower_is_better:
                row["retention"] = a / t if t else None  # undefined: printed as —
                # a target not above chance has no headroom over guessing to retain
                row["floor_retention"] = (a - chance) / (t - chance) if t > chance else None
            a_vals, t_vals = [vals[i] for i in shared], [target[i] for i in shared]
            d, dlo, dhi, p = paired_diff_ci(a_vals, t_vals)
            row.update(diff=d, diff_lo=dlo, diff_hi=dhi, p=p, p_n=len(shared))
            exact = mcnemar(a_vals, t_vals) if metric in PREDICTION else None  # right/wrong metrics only
            if exact is not None:  # (arm right where the target is wrong, and the reverse)
                row.update(mcnemar_p=exact[0], mcnemar_gained=exact[1], mcnemar_lost=exact[2])
            if byte_counts:
                paired = [i for i in shared if i in byte_counts]
                if paired:
                    bd, blo, bhi = paired_bytes_ci([vals[i] for i in paired], [target[i] for i in paired],
                                                   [byte_counts[i] for i in paired])
                    row.update(bytes_diff=bd, bytes_diff_lo=blo, bytes_diff_hi=bhi)
            share, n_agree = agreement(rows, arm, metric)
            row.update(agreement=share, agreement_n=n_agree, kappa=kappa(rows, arm, metric))
        parts = split_arm(arm)
        if parts is not None:
            rho, selector, label = parts
            plain = by_arm.get(arm_name(0, RANK, plain_label or label), {})  # (same map, or plain_label's)
            both = [i for i in items if i in target and i in plain]
            if both:  # only handoffs close the plain-transfer gap
                t2, p0, a2 = _mean_over(target, both), _mean_over(plain, both), _mean_over(vals, both)
                # None: no gap to close; + 0.0 turns -0.0 into 0.0
                row["gap_closed"] = (a2 - p0) / (t2 - p0) + 0.0 if t2 != p0 else None
            source = by_arm.get("source", {})
            both = [i for i in items if i in target and i in source]
            if both:  # the share of the source-to-target gap this handoff keeps (1.0 = the target's figure)
                t2, s0, a2 = _mean_over(target, both), _mean_over(source, both), _mean_over(vals, both)
                row["model_gap_kept"] = (a2 - s0) / (t2 - s0) + 0.0 if t2 != s0 else None
            rank = by_arm.get(arm_name(rho, RANK, label), {})
            common = [i for i in items if i in rank]
            if selector != RANK and common:  # this selector against rank disagreement at the same budget
                a_vals, r_vals = [vals[i] for i in common], [rank[i] for i in common]
                d, dlo, dhi, p = paired_diff_ci(a_vals, r_vals)
                row.update(vs_rank=d, vs_rank_lo=dlo, vs_rank_hi=dhi, vs_rank_p=p, vs_rank_n=len(common))
                exact = mcnemar(a_vals, r_vals) if metric in PREDICTION else None
                if exact is not None:
                    row["vs_rank_mcnemar_p"] = exact[0]
        out.append(row)
    return sorted(out, key=_order)


def _order(row: dict) -> tuple:
    """target, source, then per map: rank by ρ, then the other selectors."""
    parts = split_arm(row["arm"])
    if parts is None:
        return (0 if row["arm"] == "target" else 1,)
    rho, selector, label = parts
    return (2, label, selector != RANK, selector, rho)


def _share(rows: list[dict], arm: str, field: str) -> float | None:
    vals = [bool(r[field]) for r in rows if r["arm"] == arm and field in r]
    return sum(vals) / len(vals) if vals else None


def truncated(rows: list[dict], arm: str) -> tuple[int, int] | None:
    """How many of `arm`'s generations stopped at the length cap (`truncated`), of how many; None where no
    row records it (likelihood tasks; generations written before 2026-12-07, see `mark_truncated`)."""
    flags = [bool(r["truncated"]) for r in rows if r["arm"] == arm and "truncated" in r]
    return (sum(flags), len(flags)) if flags else None


def mark_truncated(rows: list[dict], cap: int | None) -> list[dict]:
    """Generation rows written before `truncated` was recorded, marked by their length: `new_tokens` at the
    run's cap (`cap`, from its record) means the cap stopped them (or, rarely, an answer ended exactly there)."""
    if cap is None:
        return rows
    return [r if "truncated" in r or "new_tokens" not in r else {**r, "truncated": r["new_tokens"] >= cap}
            for r in rows]


def top_answer(rows: list[dict], arm: str, metric: str = "correct") -> tuple[int, float] | None:
    """The choice index `arm` answers most often (the lowest on a tie) and the share of its items that answer
    it; None where the metric scores no chosen choice (bits per byte, a generated answer)."""
    field = PREDICTION.get(metric)
    # a choice index only: generative GSM8K scores `correct` on an extracted answer string
    picks = [r[field] for r in rows if r["arm"] == arm and field is not None
             and isinstance(r.get(field), int) and not isinstance(r[field], bool)]
    if not picks:
        return None
    counts = Counter(picks)
    best = min(counts, key=lambda c: (-counts[c], c))
    return best, counts[best] / len(picks)


def _template_share(rows: list[dict], arm: str) -> float | None:
    """Share of the recomputed positions that lie in text every prompt of the task shares."""
    picked = [(r["chosen_template"], r["recomputed"] - r.get("first_pass", 0)) for r in rows  # the chosen set's
              if r["arm"] == arm and "chosen_template" in r]  # size ("recomputed" counts pass 1 as well)
    total = sum(n for _, n in picked)
    return sum(c for c, _ in picked) / total if total else None


def template_prompt_share(rows: list[dict]) -> float | None:
    """Share of all prompt positions that are shared template (the selector-free baseline)."""
    seen = {r["item"]: (r["template_tokens"], r["prompt_tokens"]) for r in rows if "template_tokens" in r}
    total = sum(n for _, n in seen.values())
    return sum(t for t, _ in seen.values()) / total if total else None


def format_p(p: float, floor: bool = True) -> str:
    """Three decimals, two significant digits below 0.001; at the bootstrap's floor (`floor`: a bootstrap p),
    a bound ("< 0.0001") rather than the floor itself."""
    if floor and p <= p_floor() * (1 + 1e-9):
        return f"< {p_floor():g}"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.2g}"


def _p_cell(r: dict, key: str = "p", n_key: str = "p_n", exact: str | None = None) -> str:
    """A p-value with the number of paired items it rests on (and McNemar's exact p from `exact`, where the
    outcomes are binary), or — when there is none."""
    if r.get(key) is None:
        return "—"
    mc = f"; McNemar {format_p(r[exact], floor=False)}" if exact and r.get(exact) is not None else ""
    return f"{format_p(r[key])} (n={r[n_key]}{mc})"


def _count_cell(pair: tuple[int, int] | None) -> str:
    return "—" if pair is None else f"{pair[0]} of {pair[1]}"


def markdown(summary: list[dict], title: str = "", metric: str = "accuracy", percent: bool = True,
             template_share: float | None = None, plain_label: str | None = None,
             shas: dict[str, str] | None = None) -> str:
    """The full table, one row per arm (arms named with their map's sha256 prefix given `shas`). Columns that
    only some tasks have come where they apply: McNemar's exact p (right/wrong outcomes), bits per byte
    weighted by bytes (bpb with byte counts), ties (multiple choice) and generations cut at the cap."""
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.4f}")
    fd = (lambda x: f"{x:+.1%}") if percent else (lambda x: f"{x:+.4f}")
    head = [f"**{title}**", ""] if title else []
    if template_share is not None:
        head += [f"Shared template (instruction, exemplars, chat markup) is {template_share:.0%} of the prompt "
                 "positions; the \"template share of picks\" column is its share of the positions each arm recomputed.", ""]

    def has(key: str) -> bool:
        return any(r.get(key) is not None for r in summary)

    def opt(r, key, fmt="{:.1%}"):
        return fmt.format(r[key]) if r.get(key) is not None else "—"

    def interval(r, key):
        return f"{fd(r[key])} ({fd(r[key + '_lo'])}, {fd(r[key + '_hi'])})" if r.get(key) is not None else "—"

    def vs_rank(r):
        if "vs_rank" not in r:
            return "—"
        mc = f", McNemar {format_p(r['vs_rank_mcnemar_p'], floor=False)}" if "vs_rank_mcnemar_p" in r else ""
        return f"{fd(r['vs_rank'])} (p {format_p(r['vs_rank_p'])}{mc}, n={r['vs_rank_n']})"

    def gained_lost(r):
        return "—" if "mcnemar_p" not in r else (f"{format_p(r['mcnemar_p'], floor=False)} "
                                                f"(+{r['mcnemar_gained']} / −{r['mcnemar_lost']})")

    columns = [("arm", lambda r: display(r["arm"], shas)), ("n", lambda r: str(r["n"])),
               (metric, lambda r: f(r["mean"])), ("95% CI", lambda r: f"{f(r['lo'])}–{f(r['hi'])}")]
    if has("bytes_mean"):
        columns.append(("by bytes: total bits / total bytes", lambda r: opt(r, "bytes_mean", "{:.4f}")))
    columns += [("retention", lambda r: opt(r, "retention")), ("floor-norm. retention", lambda r: opt(r, "floor_retention")),
                (gap_closed_header(plain_label), lambda r: opt(r, "gap_closed")),
                ("Δ vs target (95% CI)", lambda r: interval(r, "diff"))]
    if has("bytes_diff"):
        columns.append(("Δ by bytes vs target (95% CI)", lambda r: interval(r, "bytes_diff")))
    columns.append(("p vs target (n)", _p_cell))
    if has("mcnemar_p"):
        columns.append(("McNemar p vs target (right only here / only the target)", gained_lost))
    columns += [("Δ vs rank (p, n)", vs_rank), ("agreement with target (n)", _agreement_cell),
                ("κ vs target", lambda r: opt(r, "kappa", "{:.2f}")), ("pos 0 chosen", lambda r: opt(r, "position0", "{:.0%}")),
                ("template share of picks", lambda r: opt(r, "template_share", "{:.0%}")), ("most given answer", _top_cell)]
    if has("ties"):
        columns.append(("ties (top choices equal)", lambda r: _count_cell(r.get("ties"))))
    if has("truncated"):
        columns.append(("cut at the token cap", lambda r: _count_cell(r.get("truncated"))))
    lines = head + ["| " + " | ".join(h for h, _ in columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in summary]
    return "\n".join(lines)


def _agreement_cell(r: dict) -> str:
    """The share of answers equal to the target's, with its n; — for the target itself and bits per byte."""
    return f"{r['agreement']:.0%} (n={r['agreement_n']})" if r.get("agreement") is not None else "—"


def _top_cell(r: dict) -> str:
    """The most given answer as its letter (choice 0 = A) and share, or — (bits per byte)."""
    top = r.get("top_answer")
    if top is None:
        return "—"
    return f"{chr(ord('A') + top[0]) if 0 <= top[0] < 26 else top[0]} {top[1]:.0%}"


def by_turn(rows: list[dict], metric: str, percent: bool = True) -> str | None:
    """Multi-turn tasks: the metric per arm at each turn of the conversation (drift across turns)."""
    cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "turn" in r and metric in r:
            cells[r["arm"]][int(r["turn"])].append(float(r[metric]))
    if not cells:
        return None
    turns = sorted({t for c in cells.values() for t in c})
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.3f}")
    arms = sorted(cells, key=lambda a: _order({"arm": a}))
    lines = [f"{metric} by turn (items per cell: " + ", ".join(f"t{t}: {len(cells[arms[0]][t])}" for t in turns) + ")",
             "", "| arm | " + " | ".join(f"t{t}" for t in turns) + " |", "|---" * (len(turns) + 1) + "|"]
    for a in arms:
        vals = [f(sum(cells[a][t]) / len(cells[a][t])) if cells[a][t] else "—" for t in turns]
        lines.append(f"| {a} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def compact(summary: list[dict], metric: str, percent: bool = True, plain_label: str | None = None,
            shas: dict[str, str] | None = None) -> str:
    """One row per arm, one column group per map: the metric with its interval, floor-normalised
    retention (or, for lower-is-better metrics, the difference to the target), gap closed, the share
    of the source-to-target gap kept and the p-values against the target and against rank
    disagreement at the same budget (with McNemar's exact p on right/wrong outcomes). Map labels carry their
    sha256 prefix given `shas`."""
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.4f}")
    labels = sorted({split_arm(r["arm"])[2] for r in summary if split_arm(r["arm"])}) or [""]  # "": no handoff arm
    cells: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in summary:
        parts = split_arm(r["arm"])
        key = r["arm"] if parts is None else arm_name(parts[0], parts[1])
        cells[key][parts[2] if parts else ""] = r
    second = "floor-norm. ret." if percent else "Δ vs target"
    groups = (f"{map_tag(lab, shas) if lab else 'map'}: {metric} (95% CI) | {second} | {gap_closed_header(plain_label)} | {GAP_KEPT} | p vs target (n) | "
              "p vs rank (n)" for lab in labels)
    head = "| arm | " + " | ".join(groups) + " |"
    lines = [head, "|---" * (1 + 6 * len(labels)) + "|"]
    for key, by_label in cells.items():
        row = [display(key)]
        for lab in labels:
            r = by_label.get(lab) or by_label.get("")
            if r is None:
                row += ["—"] * 6
                continue
            val = f"{f(r['mean'])} ({f(r['lo'])}–{f(r['hi'])})"
            if not percent:
                other = f"{r['diff']:+.4f}" if "diff" in r else "—"
            else:
                other = f"{r['floor_retention']:.0%}" if r.get("floor_retention") is not None else "—"
            gap = f"{r['gap_closed']:.0%}" if r.get("gap_closed") is not None else "—"
            kept = f"{r['model_gap_kept']:.0%}" if r.get("model_gap_kept") is not None else "—"
            row += [val, other, gap, kept, _p_cell(r, exact="mcnemar_p"),
                    _p_cell(r, "vs_rank_p", "vs_rank_n", "vs_rank_mcnemar_p")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
