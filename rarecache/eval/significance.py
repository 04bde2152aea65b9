"""Accuracy with bootstrap confidence intervals (paired across arms on the same items), the exact McNemar
test for paired right/wrong outcomes, and bits per byte weighted by bytes.

Every bootstrap draws N_BOOT resamples: at 2,000 an interval's end moved across 0 between two seeds
(issue 54); 10,000 keeps an end's resampling noise a fraction of the interval's width. The bootstrap's
p-value cannot go below 1 / N_BOOT; McNemar's can, and it needs no resampling: on binary outcomes it is
the test to read, the bootstrap interval the size of the difference.
"""

from __future__ import annotations

import math

import numpy as np

N_BOOT = 10_000  # bootstrap resamples


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


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant pairs: `b` items right only under one arm, `c`
    right only under the other. Under no difference each discordant item is a fair coin, so p is twice the
    binomial(b + c, 1/2) tail at min(b, c), capped at 1 (1.0 with no discordant item)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2 ** n)  # (integers until the division: exact for any n)


def is_binary(values: list[float]) -> bool:
    """Whether every value is 0 or 1 (right/wrong outcomes, which McNemar's test reads)."""
    return bool(values) and all(v in (0.0, 1.0) for v in values)


def mcnemar(a: list[float], b: list[float]) -> tuple[float, int, int] | None:
    """McNemar's exact p for paired binary outcomes `a` and `b` over the same items, with the discordant
    counts (a right where b is wrong, b right where a is wrong); None unless both are binary."""
    if len(a) != len(b) or not (is_binary(a) and is_binary(b)):
        return None
    only_a = sum(1 for x, y in zip(a, b) if x > y)
    only_b = sum(1 for x, y in zip(a, b) if y > x)
    return mcnemar_exact(only_a, only_b), only_a, only_b


def bytes_bpb(bpb: list[float], n_bytes: list[int]) -> float:
    """Bits per byte over a set of items weighted by bytes: total bits over total bytes, the figure of the
    text as a whole (sum of nats / (ln 2 · sum of bytes)). The mean of per-item ratios weighs a 5-byte answer
    as much as a 500-byte one, so a few short answers can move it far."""
    total = sum(n_bytes)
    return sum(x * n for x, n in zip(bpb, n_bytes)) / total if total else float("nan")


def paired_bytes_ci(a: list[float], b: list[float], n_bytes: list[int], n_boot: int = N_BOOT, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """Byte-weighted bpb of `a` minus that of `b` on the same items (each item's bytes the same under both),
    with a percentile-bootstrap interval resampling items: sum of (a − b) · bytes over sum of bytes."""
    d = (np.asarray(a, dtype=float) - np.asarray(b, dtype=float)) * np.asarray(n_bytes, dtype=float)
    w = np.asarray(n_bytes, dtype=float)
    if len(d) == 0 or w.sum() == 0:
        return (float("nan"),) * 3
    idx = np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))
    boots = d[idx].sum(1) / w[idx].sum(1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return float(d.sum() / w.sum()), float(lo), float(hi)
