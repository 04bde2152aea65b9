"""Summaries of a results file: the metric per arm with bootstrap intervals, retention against the
target, floor-normalised retention, the share of the plain-transfer gap closed, paired tests."""

from __future__ import annotations

from collections import defaultdict

from .metrics import mean_ci, paired_diff_ci

PLAIN = "rho=0/rank"  # plain transfer, the reference for "gap closed"


def summarise(rows: list[dict], metric: str = "correct", chance: float = 0.0,
              lower_is_better: bool = False) -> list[dict]:
    by_arm: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if metric in r:
            by_arm[r["arm"]][r["item"]] = float(r[metric])
    target, plain = by_arm.get("target", {}), by_arm.get(PLAIN, {})
    out = []
    for arm, vals in by_arm.items():
        items = sorted(vals)
        m, lo, hi = mean_ci([vals[i] for i in items])
        row = {"arm": arm, "n": len(items), "mean": m, "lo": lo, "hi": hi,
               "position0": _share(rows, arm, "position0")}
        shared = [i for i in items if i in target]
        if target and arm != "target" and shared:
            t = sum(target[i] for i in shared) / len(shared)
            a = sum(vals[i] for i in shared) / len(shared)
            if not lower_is_better:
                row["retention"] = a / t if t else float("nan")
                row["floor_retention"] = (a - chance) / (t - chance) if t != chance else float("nan")
            d, dlo, dhi, p = paired_diff_ci([vals[i] for i in shared], [target[i] for i in shared])
            row.update(diff=d, diff_lo=dlo, diff_hi=dhi, p=p)
            both = [i for i in shared if i in plain]
            if plain and both and arm.startswith("rho="):  # only handoffs close the plain-transfer gap
                t2 = sum(target[i] for i in both) / len(both)
                p0 = sum(plain[i] for i in both) / len(both)
                a2 = sum(vals[i] for i in both) / len(both)
                row["gap_closed"] = (a2 - p0) / (t2 - p0) if t2 != p0 else float("nan")
        out.append(row)
    order = {"target": 0, "source": 1}
    return sorted(out, key=lambda r: (order.get(r["arm"], 2), r["arm"]))


def _share(rows: list[dict], arm: str, field: str) -> float | None:
    vals = [bool(r[field]) for r in rows if r["arm"] == arm and field in r]
    return sum(vals) / len(vals) if vals else None


def markdown(summary: list[dict], title: str = "", metric: str = "accuracy", percent: bool = True) -> str:
    f = (lambda x: f"{x:.1%}") if percent else (lambda x: f"{x:.4f}")
    fd = (lambda x: f"{x:+.1%}") if percent else (lambda x: f"{x:+.4f}")
    lines = ([f"**{title}**", ""] if title else []) + [
        f"| arm | n | {metric} | 95% CI | retention | floor-norm. retention | gap closed | Δ vs target (95% CI) | p "
        "| pos 0 chosen |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        def opt(key, fmt="{:.1%}"):
            return fmt.format(r[key]) if r.get(key) is not None and key in r else "—"
        diff = f"{fd(r['diff'])} ({fd(r['diff_lo'])}, {fd(r['diff_hi'])})" if "diff" in r else "—"
        lines.append(f"| {r['arm']} | {r['n']} | {f(r['mean'])} | {f(r['lo'])}–{f(r['hi'])} | {opt('retention')} | "
                     f"{opt('floor_retention')} | {opt('gap_closed')} | {diff} | {opt('p', '{:.3f}')} | "
                     f"{opt('position0', '{:.0%}')} |")
    return "\n".join(lines)
