"""How well each signal a ladder records predicts a changed answer: ROC AUC with bootstrap intervals,
pooled over rungs and within each rung, for every signal alone and for a cross-validated combination
(logistic regression, k-fold by item, so no item is scored by a model that saw it).

A pair is one (item, rung): the rung's signal against whether its answer differs from the target's own
(multiple choice: another answer; bits per byte: worse than the target by more than `CHANGED_BPB`, an
improvement is no change). Each signal is oriented so that higher means "more likely changed"
(`SIGNALS`: the top-2 margin and the probe cosine count negated), so an AUC above 0.5 is a signal in the
expected direction. Intervals resample items (within each task when pooled over tasks), keeping an
item's rungs together: they are not independent draws.
"""

from __future__ import annotations

import numpy as np

from .significance import N_BOOT

# recorded per rung -> +1: higher means changed more likely; -1: lower does
SIGNALS = {"js": 1, "js_plain": 1, "js_source": 1, "js_views": 1, "answer_views": 1, "margin": -1, "entropy": 1,
           "outside": 1, "row_error": 1, "nll": 1, "nll_shift": 1, "nll_gap": 1, "probe_cos": -1}
COMBINED = "combined"  # the cross-validated logistic combination of every signal recorded
FOLDS = 5


def auc(scores, labels) -> float:
    """ROC AUC of `scores` for `labels` (Mann–Whitney by mid-ranks: ties count half); nan without both
    classes."""
    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    mid = np.cumsum(counts) - (counts - 1) / 2  # each distinct score's mean rank, from 1
    return float((mid[inv][y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def auc_ci(per_item: list[tuple[list[float], list[bool]]], n_boot: int = N_BOOT, seed: int = 0,
           strata: list[int] | None = None) -> tuple[float, float, float]:
    """AUC over every (item, rung) pair, with a bootstrap interval resampling items (within each
    stratum, e.g. task, when `strata` gives one per item: a pooled AUC keeps every task's weight).
    A draw weighs each pair by how often its item was drawn; all draws are scored at once over the
    pairs sorted by score (a weighted Mann–Whitney count, ties half)."""
    scores = np.array([s for it in per_item for s in it[0]], dtype=float)
    labels = np.array([c for it in per_item for c in it[1]], dtype=bool)
    owner = np.array([i for i, it in enumerate(per_item) for _ in it[0]], dtype=int)
    point = auc(scores, labels)
    if not len(scores):
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(np.asarray(strata) == g) for g in sorted(set(strata))] if strata else [
        np.arange(len(per_item))]
    order = np.argsort(scores, kind="stable")
    s, y, owner = scores[order], labels[order], owner[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # each distinct score's first pair
    boots = []
    for a in range(0, n_boot, 250):  # (draws in blocks: a (draws, pairs) weight matrix each)
        counts = np.zeros((min(250, n_boot - a), len(per_item)))
        for g in groups:
            counts[:, g] = rng.multinomial(len(g), np.full(len(g), 1 / len(g)), size=len(counts))
        w = counts[:, owner]  # (B, P) each pair's weight in each draw
        wp, wn = (np.add.reduceat(w * m, starts, axis=1) for m in (y, ~y))  # (B, U) per distinct score
        below = np.cumsum(wn, axis=1) - wn
        num, den = (wp * (below + 0.5 * wn)).sum(1), wp.sum(1) * wn.sum(1)
        boots.append(num[den > 0] / den[den > 0])
    boots = np.concatenate(boots)
    if not len(boots):
        return point, float("nan"), float("nan")
    lo, hi = np.quantile(boots, [0.025, 0.975])
    return point, float(lo), float(hi)


def logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, steps: int = 50) -> np.ndarray:
    """L2-penalised logistic regression by Newton's method: x (N, F) -> weights (F + 1,), intercept last
    (not penalised)."""
    a = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(a.shape[1])
    pen = np.full(a.shape[1], l2)
    pen[-1] = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(a @ w, -30, 30)))
        grad = a.T @ (p - y) + pen * w
        hess = (a * (p * (1 - p))[:, None]).T @ a + np.diag(pen) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return w


def cross_validated(features: np.ndarray, labels: np.ndarray, item: np.ndarray, folds: int = FOLDS,
                    seed: int = 0) -> np.ndarray:
    """Out-of-fold scores of a logistic combination of `features` (N pairs, F), folds by `item` (N,): each
    pair is scored by a model fitted on the other folds' items (standardised on them too)."""
    ids = np.unique(item)
    fold_of = dict(zip(np.random.default_rng(seed).permutation(ids), np.arange(len(ids)) % max(2, folds)))
    fold = np.array([fold_of[i] for i in item])
    out = np.zeros(len(labels))
    for f in np.unique(fold):
        train, test = fold != f, fold == f
        mu, sd = features[train].mean(0), features[train].std(0)
        sd[sd == 0] = 1.0
        z = lambda a: (a - mu) / sd  # noqa: E731
        y = labels[train].astype(float)
        if y.min() == y.max():  # one class in training: no ranking learnt
            out[test] = 0.0
            continue
        w = logistic(z(features[train]), y)
        out[test] = z(features[test]) @ w[:-1] + w[-1]
    return out


def signal_aucs(rows: list[list[dict]], changed: list[list[bool]], rungs: list[float], strata: list[int] | None = None,
                n_boot: int = N_BOOT) -> dict:
    """Per signal recorded on every rung of every item (and the combination): its AUC and interval pooled
    over rungs, and within each rung. `rows[i][r]`: item i's rung r as recorded; `changed[i][r]`.
    Returns {"pooled": {signal: {"auc", "ci", "n"}}, "rungs": {rho: {signal: {...}}}}."""
    names = [s for s in SIGNALS if rows and all(s in g for r in rows for g in r)]
    score = {s: [[SIGNALS[s] * float(g[s]) for g in r] for r in rows] for s in names}
    if len(names) > 1:
        flat = np.array([[score[s][i][k] for s in names] for i, r in enumerate(rows) for k in range(len(r))])
        item = np.array([i for i, r in enumerate(rows) for _ in r])
        y = np.array([c for cs in changed for c in cs], dtype=bool)
        oof = iter(cross_validated(flat, y, item).tolist())
        score[COMBINED] = [[next(oof) for _ in r] for r in rows]
    def cell(s: str, ks) -> dict:  # the AUC of signal s over the rungs ks(item) of every item
        pairs = [([score[s][i][k] for k in ks(r)], [changed[i][k] for k in ks(r)]) for i, r in enumerate(rows)]
        a, lo, hi = (None if x != x else x for x in auc_ci(pairs, n_boot, strata=strata))  # (nan: one class only)
        return {"auc": a, "ci": [lo, hi], "n": sum(len(p[0]) for p in pairs),
                "changed": int(sum(sum(p[1]) for p in pairs))}

    out = {"pooled": {s: cell(s, lambda r: range(len(r))) for s in score}, "rungs": {}}
    for k, rho in enumerate(rungs):
        out["rungs"][f"{rho:g}"] = {s: cell(s, lambda r, k=k: [k]) for s in score}
    return out
