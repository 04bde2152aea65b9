"""Bootstrap intervals of the evaluation's headline ratios."""

from __future__ import annotations

import pytest


def test_gap_closed_interval_is_exact_for_a_planted_share_and_widens_as_the_gap_narrows():
    """An arm that closes exactly 90% of every item's gap has the interval [0.9, 0.9]; on noisy items the
    interval holds the point estimate, and the same noise over a narrower gap gives a wider interval."""
    import numpy as np

    from rarecache.eval.significance import gap_closed_ci

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


def test_exact_mcnemar_matches_known_binomial_tails():
    """Two-sided exact McNemar = binomial test of the discordant pairs at 1/2: scipy.stats.binomtest(1, 10)
    gives 0.021484375 (11 / 512), binomtest(2, 10) 0.109375 (56 / 512), binomtest(0, 5) 0.0625; no discordant
    item or an even split gives 1. For many pairs it approaches the continuity-corrected chi-square: 40 against
    60 gives chi2 (|40 - 60| - 1)^2 / 100 = 3.61, p 0.0574, the exact test 0.0569."""
    import math

    from rarecache.eval.significance import mcnemar, mcnemar_exact

    assert mcnemar_exact(1, 9) == mcnemar_exact(9, 1) == 0.021484375
    assert mcnemar_exact(2, 8) == 0.109375 and mcnemar_exact(0, 5) == 0.0625
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(7, 7) == 1.0 and mcnemar_exact(3, 4) == 1.0
    chi2_p = math.erfc(math.sqrt((abs(40 - 60) - 1) ** 2 / 100) / math.sqrt(2))  # chi-square, 1 degree of freedom
    assert chi2_p == pytest.approx(0.0574, abs=1e-4) and mcnemar_exact(40, 60) == pytest.approx(chi2_p, abs=1e-3)
    assert mcnemar_exact(40, 60) < chi2_p  # the corrected chi-square is conservative here
    # many pairs: exact integers until one division (2 / 2^2000 rounds to 0.0 rather than overflowing)
    assert mcnemar_exact(0, 2000) == 0.0 and mcnemar_exact(1000, 1000) == 1.0
    # paired lists: the arm right where the other is wrong on 1 item, the reverse on 3; concordant items count nothing
    assert mcnemar([1, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]) == (mcnemar_exact(1, 3), 1, 3)
    assert mcnemar([0.5, 1.0], [1.0, 1.0]) is None and mcnemar([True, False], [1, 0]) == (1.0, 0, 0)


def test_bits_per_byte_weighted_by_bytes_by_hand():
    """Two items of 1 and 3 bytes at 1.0 and 2.0 bpb: by bytes (1·1 + 2·3) / 4 = 1.75 bits per byte, against a
    mean of ratios of 1.5. Paired: +0.5 on the 2-byte item and 0 on the 8-byte one is +0.1 by bytes (the mean of
    ratios says +0.25); the interval resamples items, so it lies between the two items' own differences."""
    from rarecache.eval.significance import bytes_bpb, paired_bytes_ci

    assert bytes_bpb([1.0, 2.0], [1, 3]) == pytest.approx(1.75)
    d, lo, hi = paired_bytes_ci([1.5, 2.0], [1.0, 2.0], [2, 8])
    assert d == pytest.approx(0.1) and 0.0 <= lo <= d <= hi <= 0.5
    assert paired_bytes_ci([2.0, 3.0], [1.0, 2.0], [5, 7]) == pytest.approx((1.0, 1.0, 1.0))


def test_bootstrap_draws_ten_thousand_resamples():
    """At 2,000 resamples an interval's end moved across 0 between seeds (issue 54): the default is 10,000, and
    the p-value floor follows it."""
    from rarecache.eval.significance import N_BOOT, p_floor, paired_diff_ci

    assert N_BOOT >= 10_000 and p_floor() == 1 / N_BOOT
    assert paired_diff_ci([1.0] * 5, [0.0] * 5)[3] == pytest.approx(1 / N_BOOT)
