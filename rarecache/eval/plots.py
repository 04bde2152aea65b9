"""Accuracy against ρ with target and source reference lines (the RaReCache paper, arXiv 2610.11358,
fig. 6), and selectors side by side at one budget (fig. 7), drawn from results files; one series per map
when a run has several."""

from __future__ import annotations

from pathlib import Path

from ..registry import RANK
from ..transfer.map_plots import use_matplotlib
from .report import is_oracle, split_arm, summarise


def _arms(rows: list[dict], metric: str, lower_is_better: bool) -> dict[str, dict]:
    return {r["arm"]: r for r in summarise(rows, metric, lower_is_better=lower_is_better)}


def _references(ax, arms: dict[str, dict]) -> None:
    for ref, style in (("target", "-"), ("source", "--")):
        if ref in arms:
            ax.axhline(arms[ref]["mean"], color="grey", linestyle=style, label=f"{ref} alone")


def _err(rows: list[dict]) -> list[list[float]]:
    return [[r["mean"] - r["lo"] for r in rows], [r["hi"] - r["mean"] for r in rows]]


def plot_vs_rho(rows: list[dict], metric: str, out: Path, title: str, selector: str = RANK,
                lower_is_better: bool = False) -> None:
    use_matplotlib()
    import matplotlib.pyplot as plt

    arms = _arms(rows, metric, lower_is_better)
    series: dict[str, list[tuple[float, dict]]] = {}
    for a, r in arms.items():
        parts = split_arm(a)
        if parts is not None and parts[1] == selector:
            series.setdefault(parts[2], []).append((parts[0], r))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, (label, pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda p: p[0])
        shift = (k - (len(series) - 1) / 2) * 0.006  # keep error bars of several maps apart
        ax.errorbar([x + shift for x, _ in pts], [r["mean"] for _, r in pts], yerr=_err([r for _, r in pts]),
                    fmt="o-", capsize=3, label=f"handoff ({selector}{', map ' + label if label else ''})")
    _references(ax, arms)
    ax.set_xlabel("recompute fraction ρ")
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over the data
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_selectors(rows: list[dict], metric: str, out: Path, title: str, rho: float = 0.3,
                   lower_is_better: bool = False) -> None:
    use_matplotlib()
    import matplotlib.pyplot as plt

    arms = _arms(rows, metric, lower_is_better)
    groups: dict[str, dict[str, dict]] = {}
    for a, r in arms.items():
        parts = split_arm(a)
        if parts is not None and abs(parts[0] - rho) < 1e-9:
            groups.setdefault(parts[2], {})[parts[1]] = r
    selectors = sorted({s for g in groups.values() for s in g}, key=lambda s: (s != RANK, is_oracle(s), s))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / max(len(groups), 1)
    for k, (label, g) in enumerate(sorted(groups.items())):
        xs = [j + (k - (len(groups) - 1) / 2) * width for j, s in enumerate(selectors) if s in g]
        bars = [g[s] for s in selectors if s in g]
        ax.bar(xs, [r["mean"] for r in bars], width, yerr=_err(bars), capsize=3,
               label=f"map {label}" if label else None)
    ax.set_xticks(range(len(selectors)), [s + (" (oracle)" if is_oracle(s) else "") for s in selectors],
                  rotation=20, fontsize=8)
    _references(ax, arms)
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better else ""))
    ax.set_title(f"{title} (ρ = {rho:g})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over the data
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
