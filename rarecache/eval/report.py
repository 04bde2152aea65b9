"""Summaries of a results file: accuracy per arm with bootstrap intervals, retention, paired tests."""

from __future__ import annotations

from collections import defaultdict

from .metrics import mean_ci, paired_diff_ci


def summarise(rows: list[dict], metric: str = "correct") -> list[dict]:
    by_arm: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_arm[r["arm"]][r["item"]] = float(r[metric])
    target = by_arm.get("target", {})
    out = []
    for arm, vals in by_arm.items():
        items = sorted(vals)
        acc, lo, hi = mean_ci([vals[i] for i in items])
        row = {"arm": arm, "n": len(items), "acc": acc, "lo": lo, "hi": hi}
        shared = [i for i in items if i in target]
        if target and arm != "target" and shared:
            t_acc = sum(target[i] for i in shared) / len(shared)
            row["retention"] = acc / t_acc if t_acc else float("nan")
            d, dlo, dhi, p = paired_diff_ci([vals[i] for i in shared], [target[i] for i in shared])
            row.update(diff=d, diff_lo=dlo, diff_hi=dhi, p=p)
        out.append(row)
    order = {"target": 0, "source": 1}
    return sorted(out, key=lambda r: (order.get(r["arm"], 2), r["arm"]))


def markdown(summary: list[dict], title: str = "") -> str:
    lines = ([f"**{title}**", ""] if title else []) + [
        "| arm | n | accuracy | 95% CI | retention | Δ vs target (95% CI) | p |",
        "|---|---|---|---|---|---|---|"]
    for r in summary:
        ret = f"{r['retention']:.1%}" if "retention" in r else "—"
        diff = f"{r['diff']:+.1%} ({r['diff_lo']:+.1%}, {r['diff_hi']:+.1%})" if "diff" in r else "—"
        p = f"{r['p']:.3f}" if "p" in r else "—"
        lines.append(f"| {r['arm']} | {r['n']} | {r['acc']:.1%} | {r['lo']:.1%}–{r['hi']:.1%} | {ret} | {diff} | {p} |")
    return "\n".join(lines)
