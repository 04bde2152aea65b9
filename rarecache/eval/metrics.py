"""Accuracy with bootstrap confidence intervals (paired across arms on the same items)."""

from __future__ import annotations

import numpy as np

N_BOOT = 2000  # bootstrap resamples


def p_floor(n_boot: int = N_BOOT) -> float:
    """The smallest bootstrap p-value `paired_diff_ci` reports: no resample on the other side of zero
    says only that p is below about 1/n_boot (reports print it as a bound)."""
    return 1 / n_boot


def mean_ci(values: list[float], n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap interval over items."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, len(x), (n_boot, len(x)))].mean(1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(lo), float(hi)


def gap_closed_ci(target: list[float], plain: list[float], arm: list[float], n_boot: int = N_BOOT, seed: int = 0,
                  level: float = 0.95) -> tuple[float, float, float]:
    """Share of the gap from `plain` to `target` that `arm` closes, (arm − plain) / (target − plain) of the
    means over the same items, with a paired percentile-bootstrap interval (the items resampled together;
    a resample with no gap left is dropped). The ratio of two noisy means: its interval is wide where the
    gap is narrow."""
    t, p, a = (np.asarray(v, dtype=float) for v in (target, plain, arm))
    if len(t) == 0 or t.mean() == p.mean():
        return (float("nan"),) * 3
    idx = np.random.default_rng(seed).integers(0, len(t), (n_boot, len(t)))
    den = t[idx].mean(1) - p[idx].mean(1)
    ok = den != 0
    boots = (a[idx].mean(1)[ok] - p[idx].mean(1)[ok]) / den[ok]
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return float((a.mean() - p.mean()) / (t.mean() - p.mean())), float(lo), float(hi)


def paired_diff_ci(a: list[float], b: list[float], n_boot: int = N_BOOT, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float, float]:
    """Mean of a − b over the same items, its bootstrap interval, and a two-sided bootstrap p-value."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if len(d) == 0:
        return (float("nan"),) * 4
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    # p: how often the resampled mean lands on the other side of zero (doubled), floored at p_floor
    side = (boots <= 0).mean() if d.mean() > 0 else (boots >= 0).mean()
    p = 1.0 if d.mean() == 0 else min(1.0, max(2 * side, p_floor(n_boot)))
    return float(d.mean()), float(lo), float(hi), float(p)
