"""Bootstrap intervals of the evaluation's headline ratios."""

from __future__ import annotations

import pytest


def test_gap_closed_interval_is_exact_for_a_planted_share_and_widens_as_the_gap_narrows():
    """An arm that closes exactly 90% of every item's gap has the interval [0.9, 0.9]; on noisy items the
    interval holds the point estimate, and the same noise over a narrower gap gives a wider interval."""
    import numpy as np

    from rarecache.eval.metrics import gap_closed_ci

    rng = np.random.default_rng(0)
    plain = rng.normal(0.5, 0.1, 200)
    target = plain + rng.uniform(0.05, 0.2, 200)
    m, lo, hi = gap_closed_ci(target.tolist(), plain.tolist(), (plain + 0.9 * (target - plain)).tolist())
    assert m == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(0.9)
    widths = []
    for gap in (0.2, 0.02):
        t = plain + gap + rng.normal(0, 0.05, 200)
        a = plain + 0.5 * gap + rng.normal(0, 0.05, 200)
        m, lo, hi = gap_closed_ci(t.tolist(), plain.tolist(), a.tolist())
        assert lo <= m <= hi
        widths.append(hi - lo)
    assert widths[1] > 3 * widths[0]
    assert all(np.isnan(gap_closed_ci([1.0], [1.0], [1.0])))
