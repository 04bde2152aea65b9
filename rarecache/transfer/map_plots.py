"""Pictures of a map (matplotlib, imported only when drawing)."""

from __future__ import annotations

from pathlib import Path


def use_matplotlib():
    """matplotlib, set to draw into files only (the Agg backend); a RarecacheError naming the extra
    to install when it is missing. Call it before importing `matplotlib.pyplot`."""
    try:
        import matplotlib
    except ImportError:
        from ..errors import RarecacheError

        raise RarecacheError("plots need matplotlib: pip install 'rarecache[plot]'") from None
    matplotlib.use("Agg")
    return matplotlib


def plot_r2(mapper, out: Path) -> None:
    use_matplotlib()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for side, name, color in (("k", "keys", "tab:blue"), ("v", "values", "tab:orange")):
        r2 = mapper.sides[side].r2.tolist()
        ax.plot(range(len(r2)), r2, "o-", color=color, label=f"{name} (in-sample)")
        held = mapper.info.r2_heldout.get(side)
        if held:
            ax.plot(range(len(held)), held, "x--", color=color, alpha=0.7, label=f"{name} (held-out)")
    ax.set_xlabel("target layer")
    ax.set_ylabel("R²")
    ax.set_ylim(0, 1)
    ax.set_title(f"{mapper.info.direction}, k={mapper.info.k}, {mapper.info.tokens} tokens", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_strip(tokens: list[str], picks: dict[str, list[int]], scores: list[float] | None, rho: float,
               out: Path, title: str = "") -> None:
    """Token strip (the RaReCache paper, arXiv 2610.11358, fig. 13): which positions each selector
    recomputes, and rank scores."""
    matplotlib = use_matplotlib()
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(tokens)
    rows = list(picks) + (["rank score"] if scores is not None else [])
    fig, ax = plt.subplots(figsize=(min(2 + 0.12 * n, 60), 1.2 + 0.45 * len(rows) + 1.2))
    grid = np.full((len(rows), n), np.nan)
    for r, name in enumerate(picks):
        grid[r, picks[name]] = 1.0
    cmap = matplotlib.colormaps["Blues"].with_extremes(bad="white")
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=1.2, interpolation="nearest")
    if scores is not None:
        s = np.asarray(scores, dtype=float)
        s = (s - s.min()) / max(s.max() - s.min(), 1e-12)
        ax.imshow(np.ma.masked_invalid(np.vstack([np.full((len(rows) - 1, n), np.nan), s[None]])),
                  aspect="auto", cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_yticks(range(len(rows)), rows)
    step = max(1, n // 150)
    ax.set_xticks(range(0, n, step), [tokens[i] for i in range(0, n, step)], rotation=90, fontsize=6)
    ax.set_xlabel("prompt position")
    ax.set_title(title or f"positions recomputed at rho = {rho:g}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
