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
on, and at the bootstrap's floor as a bound ("< 0.001"): with no resample on the other
side of zero, the bootstrap can say no more.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from ..registry import RANK
from ..transfer.selectors import SELECTORS
from .metrics import mean_ci, p_floor, paired_diff_ci

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


def display(arm: str) -> str:
    """An arm's name as printed: oracles (which read the target's own prefill) say so."""
    parts = split_arm(arm)
    return arm + (" (oracle)" if parts is not None and is_oracle(parts[1]) else "")


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
    out = []
    for arm, vals in by_arm.items():
        items = sorted(vals)
        m, lo, hi = mean_ci([vals[i] for i in items])
        row = {"arm": arm, "n": len(items), "mean": m, "lo": lo, "hi": hi,
               "position0": _share(rows, arm, "position0"), "template_share": _template_share(rows, arm),
               "top_answer": top_answer(rows, arm, metric)}
        shared = [i for i in items if i in target]
        if target and arm != "target" and shared:
            t, a = _mean_over(target, shared), _mean_over(vals, shared)
            if not lower_is_better:
                row["retention"] = a / t if t else None  # undefined: printed as —
                # a target not above chance has no headroom over guessing to retain
                row["floor_retention"] = (a - chance) / (t - chance) if t > chance else None
            d, dlo, dhi, p = paired_diff_ci([vals[i] for i in shared], [target[i] for i in shared])
            row.update(diff=d, diff_lo=dlo, diff_hi=dhi, p=p, p_n=len(shared))
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
                d, dlo, dhi, p = paired_diff_ci([vals[i] for i in common], [rank[i] for i in common])
                row.update(vs_rank=d, vs_rank_lo=dlo, vs_rank_hi=dhi, vs_rank_p=p, vs_rank_n=len(common))
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


PREDICTION = {"correct": "prediction", "correct_norm": "prediction_norm"}  # the answer each metric scores


def answer_field(metric: str) -> str | None:
    """The record field holding the answer `metric` scores: the chosen choice (acc_norm: the length-
    normalised one) or a generated answer (GSM8K's extracted number, CoQA's answer line). None for bits
    per byte: the likelihood of a fixed text gives no answer to agree on (reports give its paired Δ)."""
    return None if metric == "bpb" else PREDICTION.get(metric, "prediction")


def _answer_pairs(rows: list[dict], arm: str, metric: str, items: set[str] | None) -> dict[str, tuple] | None:
    """Per item both answered (only `items` when given): (the target's answer, `arm`'s). None for bits per
    byte, which scores a fixed text and gives no answer."""
    field = answer_field(metric)
    if field is None:
        return None
    answers: dict[str, dict[str, object]] = {"target": {}, arm: {}}
    for r in rows:
        if r["arm"] in answers and field in r and (items is None or r["item"] in items):
            answers[r["arm"]][r["item"]] = r[field]
    return {i: (answers["target"][i], a) for i, a in answers[arm].items() if i in answers["target"]}


def agrees(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> dict[str, bool]:
    """Per item both answered (only `items` when given): whether `arm`'s answer equals the target's own.
    Empty for bits per byte, which scores a fixed text and gives no answer."""
    return {i: a == t for i, (t, a) in (_answer_pairs(rows, arm, metric, items) or {}).items()}


def kappa(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> float | None:
    """Cohen's κ between `arm`'s answers and the target's on the items both answered: agreement beyond what
    the two answers' frequencies give by chance, (p_o − p_e) / (1 − p_e). Agreement alone can be bought by
    answering the target's favourite choice (the 0.5B agrees with the 1.5B on 48% of MMLU items by answering
    B on 79% of them, where the 1.5B answers B on 56%: κ 0.02); κ cannot. None for bits per byte, no item,
    or chance agreement 1 (both always give one answer)."""
    pairs = [(repr(t), repr(a)) for t, a in (_answer_pairs(rows, arm, metric, items) or {}).values()]
    if not pairs:  # (repr: a generated answer may be any JSON value, counted as a key)
        return None
    n = len(pairs)
    t, a = Counter(p[0] for p in pairs), Counter(p[1] for p in pairs)
    observed = sum(x == y for x, y in pairs) / n
    chance = sum(t[c] * a[c] for c in t) / n ** 2
    return None if chance >= 1 else (observed - chance) / (1 - chance)


def agreement(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> tuple[float | None, int]:
    """The share of items whose answer under `arm` equals the target's own answer on the same item, and
    on how many items (both answered; only `items` when given). (None, 0) for bits per byte or no such item."""
    same = agrees(rows, arm, metric, items)
    return (sum(same.values()) / len(same), len(same)) if same else (None, 0)


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
    picked = [(r["chosen_template"], r["recomputed"]) for r in rows if r["arm"] == arm and "chosen_template" in r]
    total = sum(n for _, n in picked)
    return sum(c for c, _ in picked) / total if total else None


def template_prompt_share(rows: list[dict]) -> float | None:
    """Share of all prompt positions that are shared template (the selector-free baseline)."""
    seen = {r["item"]: (r["template_tokens"], r["prompt_tokens"]) for r in rows if "template_tokens" in r}
    total = sum(n for _, n in seen.values())
    return sum(t for t, _ in seen.values()) / total if total else None


def format_p(p: float) -> str:
    """Three decimals; at the bootstrap's floor, a bound ("< 0.001") rather than the floor itself."""
    if p <= p_floor() * (1 + 1e-9):
        return f"< {math.ceil(p_floor() * 1000 - 1e-9) / 1000:.3f}"
    return f"{p:.3f}"


def _p_cell(r: dict, key: str = "p", n_key: str = "p_n") -> str:
    """A p-value with the number of paired items it rests on, or — when there is none."""
    return f"{format_p(r[key])} (n={r[n_key]})" if r.get(key) is not None else "—"


def markdown(summary: list[dict], title: str = "", metric: str = "accuracy", percent: bool = True,
             template_share: float | None = None, plain_label: str | None = None) -> str:
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.4f}")
    fd = (lambda x: f"{x:+.1%}") if percent else (lambda x: f"{x:+.4f}")
    head = [f"**{title}**", ""] if title else []
    if template_share is not None:
        head += [f"Shared template (instruction, exemplars, chat markup) is {template_share:.0%} of the prompt "
                 "positions; the \"template share of picks\" column is its share of the positions each arm recomputed.", ""]
    lines = head + [
        f"| arm | n | {metric} | 95% CI | retention | floor-norm. retention | {gap_closed_header(plain_label)} | Δ vs target (95% CI) "
        "| p vs target (n) | Δ vs rank (p, n) | agreement with target (n) | κ vs target | pos 0 chosen "
        "| template share of picks | most given answer |", "|---" * 15 + "|"]
    for r in summary:
        def opt(key, fmt="{:.1%}"):
            return fmt.format(r[key]) if r.get(key) is not None else "—"
        diff = f"{fd(r['diff'])} ({fd(r['diff_lo'])}, {fd(r['diff_hi'])})" if "diff" in r else "—"
        vs_rank = (f"{fd(r['vs_rank'])} (p {format_p(r['vs_rank_p'])}, n={r['vs_rank_n']})" if "vs_rank" in r
                   else "—")
        lines.append(f"| {display(r['arm'])} | {r['n']} | {f(r['mean'])} | {f(r['lo'])}–{f(r['hi'])} | "
                     f"{opt('retention')} | {opt('floor_retention')} | {opt('gap_closed')} | {diff} | {_p_cell(r)} | "
                     f"{vs_rank} | {_agreement_cell(r)} | {opt('kappa', '{:.2f}')} | "
                     f"{opt('position0', '{:.0%}')} | {opt('template_share', '{:.0%}')} | {_top_cell(r)} |")
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


def compact(summary: list[dict], metric: str, percent: bool = True, plain_label: str | None = None) -> str:
    """One row per arm, one column group per map: the metric with its interval, floor-normalised
    retention (or, for lower-is-better metrics, the difference to the target), gap closed, the share
    of the source-to-target gap kept and the p-values against the target and against rank
    disagreement at the same budget."""
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.4f}")
    labels = sorted({split_arm(r["arm"])[2] for r in summary if split_arm(r["arm"])}) or [""]  # "": no handoff arm
    cells: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in summary:
        parts = split_arm(r["arm"])
        key = r["arm"] if parts is None else arm_name(parts[0], parts[1])
        cells[key][parts[2] if parts else ""] = r
    second = "floor-norm. ret." if percent else "Δ vs target"
    groups = (f"{lab or 'map'}: {metric} (95% CI) | {second} | {gap_closed_header(plain_label)} | {GAP_KEPT} | p vs target (n) | "
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
            row += [val, other, gap, kept, _p_cell(r), _p_cell(r, "vs_rank_p", "vs_rank_n")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
