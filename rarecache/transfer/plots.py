"""Pictures of a map (matplotlib, imported only when drawing)."""

from __future__ import annotations

from pathlib import Path


def plot_r2(mapper, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        from ..errors import RarecacheError

        raise RarecacheError("plots need matplotlib: pip install 'rarecache[plot]'") from None
    matplotlib.use("Agg")
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
    ax.set_title(f"{mapper.info.direction}, k={mapper.info.k}, {mapper.info.tokens} tokens")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
