"""Accuracy against ρ with target and source reference lines (seed 000 fig. 6), and selectors side by
side at one budget (fig. 7), drawn from results files."""

from __future__ import annotations

from pathlib import Path

from ..transfer.plots import _mpl
from .report import summarise


def _arms(summary: list[dict]) -> dict[str, dict]:
    return {r["arm"]: r for r in summary}


def plot_vs_rho(rows: list[dict], metric: str, out: Path, title: str, selector: str = "rank",
                lower_is_better: bool = False) -> None:
    _mpl()
    import matplotlib.pyplot as plt

    arms = _arms(summarise(rows, metric, lower_is_better=lower_is_better))
    pts = sorted((float(a.split("/")[0][4:]), r) for a, r in arms.items()
                 if a.startswith("rho=") and a.endswith(f"/{selector}"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if pts:
        xs = [x for x, _ in pts]
        ax.errorbar(xs, [r["mean"] for _, r in pts], yerr=[[r["mean"] - r["lo"] for _, r in pts],
                    [r["hi"] - r["mean"] for _, r in pts]], fmt="o-", capsize=3, label=f"handoff ({selector})")
    for ref, style in (("target", "-"), ("source", "--")):
        if ref in arms:
            ax.axhline(arms[ref]["mean"], color="grey", linestyle=style, label=f"{ref} alone")
    ax.set_xlabel("recompute fraction ρ")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_selectors(rows: list[dict], metric: str, out: Path, title: str, rho: float = 0.3,
                   lower_is_better: bool = False) -> None:
    _mpl()
    import matplotlib.pyplot as plt

    arms = _arms(summarise(rows, metric, lower_is_better=lower_is_better))
    bars = sorted((a.split("/", 1)[1], r) for a, r in arms.items() if a.startswith(f"rho={rho:g}/"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [n + (" (oracle)" if n in ("attn-target", "l2-oracle") else "") for n, _ in bars]
    ax.bar(range(len(bars)), [r["mean"] for _, r in bars],
           yerr=[[r["mean"] - r["lo"] for _, r in bars], [r["hi"] - r["mean"] for _, r in bars]], capsize=3)
    ax.set_xticks(range(len(bars)), names, rotation=20, fontsize=8)
    for ref, style in (("target", "-"), ("source", "--")):
        if ref in arms:
            ax.axhline(arms[ref]["mean"], color="grey", linestyle=style, label=f"{ref} alone")
    ax.set_ylabel(metric)
    ax.set_title(f"{title} (ρ = {rho:g})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
