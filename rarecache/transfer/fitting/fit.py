"""Closed-form map fitting from streamed statistics.

Per target layer and side: the single-source R² of every source layer, the top K
by R², ridge on the centred statistics W = (XᵀX + λI)⁻¹XᵀY with bias b = ȳ − x̄W,
and the rank-disagreement basis V_r, the top-r eigenvectors of the prediction
covariance Σ_ŷ = Wᵀ Σ_xx W (no extra pass over data). All in float64.

Head-matched maps (CacheBridge) fit each target KV head only from the same head of
the chosen source layers, so they need only the per-head blocks of XᵀX and XᵀY:
1/H of the statistics and of the weight. The source layers are chosen per target
layer for all heads at once (single-source R² pooled over heads), so the fit is a
dense `SideFit` whose weight is zero off the head blocks and runs through the same
application code; its basis is the top r of the per-head Σ_ŷ eigenvectors (the
cross-head blocks of Σ_ŷ need statistics a head-matched run does not keep).

Sharpening (`sharpen`) undoes part of ridge's shrinkage: a least-squares prediction has
R² times the variance of what it predicts, so mapped keys give the target flatter
attention than its own and mapped values weaker outputs. Scaling each layer's centred
prediction by R⁻ᵖ (p = 1/2 matches the variance) costs squared error and buys back
sharpness; what it does downstream is measured in docs/RESULTS.md §8.
"""

from __future__ import annotations


import torch

from ...errors import RarecacheError
from ..sidefit import Layout, SideFit, from_head_blocks, head_blocks
from .stats import RegressionStats


def _centred(s: RegressionStats):
    mx, my = s.sx / s.n, s.sy / s.n
    xx = s.xx - s.n * torch.outer(mx, mx)
    xy = s.xy - s.n * torch.outer(mx, my)
    sst = s.syy - s.n * my * my
    return mx, my, xx, xy, sst


def _ridge(xx: torch.Tensor, xy: torch.Tensor, lam: float) -> torch.Tensor:
    eye = torch.eye(xx.shape[0], dtype=xx.dtype, device=xx.device)
    return torch.linalg.solve(xx + lam * eye, xy)


def _sse(w: torch.Tensor, xx: torch.Tensor, xy: torch.Tensor, sst: torch.Tensor) -> torch.Tensor:
    """Per-output residual sum of squares of centred ridge: sst − 2·diag(WᵀC) + diag(WᵀGW)."""
    return sst - 2 * (w * xy).sum(0) + (w * (xx @ w)).sum(0)


def single_source_r2(s: RegressionStats, src: Layout, tgt: Layout, lam: float) -> torch.Tensor:
    """R² (Lt, Ls) of a ridge map from each single source layer to each target layer."""
    _, _, xx, xy, sst = _centred(s)
    sst_layer = sst.view(tgt.layers, tgt.width).sum(1)
    out = torch.empty(tgt.layers, src.layers, dtype=torch.float64)
    for j in range(src.layers):
        b = src.block(j)
        w = _ridge(xx[b, b], xy[b], lam)  # (ds, Lt·dt): all target layers in one solve
        sse = _sse(w, xx[b, b], xy[b], sst).view(tgt.layers, tgt.width).sum(1)
        out[:, j] = 1 - sse / sst_layer
    return out


def fit_side(s: RegressionStats, src: Layout, tgt: Layout, k: int, lam: float, rank: int) -> SideFit:
    mx, my, xx, xy, sst = _centred(s)
    r2_single = single_source_r2(s, src, tgt, lam)
    k = min(k, src.layers)
    sources, weights, biases, bases, eigs, r2 = [], [], [], [], [], []
    for l in range(tgt.layers):
        chosen = sorted(r2_single[l].topk(k).indices.tolist())
        idx, out = src.index(chosen), tgt.block(l)
        g, c = xx[idx][:, idx], xy[idx, out]
        w = _ridge(g, c, lam)  # (K·ds, dt)
        r2.append(1 - _sse(w, g, c, sst[out]).sum() / sst[out].sum())
        cov = w.T @ g @ w / s.n  # Σ_ŷ = Wᵀ Σ_xx W
        evals, evecs = torch.linalg.eigh((cov + cov.T) / 2)  # ascending
        sources.append(torch.tensor(chosen))
        weights.append(w)
        biases.append(my[out] - mx[idx] @ w)
        bases.append(evecs.flip(-1)[:, :rank])
        eigs.append(evals.flip(-1))
    return SideFit(torch.stack(sources), torch.stack(weights), torch.stack(biases), my.view(tgt.layers, tgt.width),
                   torch.stack(bases), torch.stack(eigs), torch.stack(r2), r2_single)


def _heldout_sse(w: torch.Tensor, b: torch.Tensor, s: RegressionStats, idx: torch.Tensor, blk: slice
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual and total sums of squares of ŷ = xW + b on the statistics `s` (inputs idx, outputs blk)."""
    g, c, sx, sy = s.xx[idx][:, idx], s.xy[idx, blk], s.sx[idx], s.sy[blk]
    sse = (s.syy[blk].sum() - 2 * (w * c).sum() - 2 * b @ sy + (w * (g @ w)).sum()
           + 2 * b @ (w.T @ sx) + s.n * b @ b)
    return sse, s.syy[blk].sum() - (sy @ sy) / s.n


def heldout_r2(fit: SideFit, s: RegressionStats, src: Layout, tgt: Layout) -> torch.Tensor:
    """R² (Lt,) of the fitted maps on statistics of data they were not fitted on."""
    out = torch.empty(tgt.layers, dtype=torch.float64)
    for l in range(tgt.layers):
        sse, sst = _heldout_sse(fit.weight[l], fit.bias[l], s, src.index(fit.sources[l].tolist()), tgt.block(l))
        out[l] = 1 - sse / sst
    return out


# -- head-matched maps -------------------------------------------------------------------------

def matched_heads(source_heads: int, target_heads: int) -> int:
    """The KV heads a head-matched map splits rows into, or a clear error when the pair cannot."""
    if source_heads != target_heads or source_heads < 2:
        raise RarecacheError(f"head-matched maps need as many KV heads on both sides, at least 2; this pair has "
                             f"{source_heads} and {target_heads}")
    return source_heads


def head_layouts(src: Layout, tgt: Layout, heads: int) -> tuple[Layout, Layout]:
    """One head's layouts: every layer's row holds `heads` heads side by side."""
    if src.extra:
        raise ValueError("head-matched maps read no extra input columns (token inputs)")
    if heads < 2 or src.width % heads or tgt.width % heads:
        raise ValueError(f"rows {src.width} and {tgt.width} wide do not split into {heads} heads")
    return Layout(src.layers, src.width // heads), Layout(tgt.layers, tgt.width // heads)


def head_columns(layout: Layout, heads: int, h: int) -> torch.Tensor:
    """Indices of head h's columns in a side's concatenated rows (every layer's h-th head block)."""
    d = layout.width // heads
    return (torch.arange(layout.layers)[:, None] * layout.width + h * d + torch.arange(d)).flatten()


def head_rows(x: torch.Tensor, layout: Layout, heads: int, h: int) -> torch.Tensor:
    """Rows (N, L·H·D) -> head h's rows (N, L·D)."""
    return x[:, head_columns(layout, heads, h).to(x.device)]


def head_stats(dense: RegressionStats, src: Layout, tgt: Layout, heads: int) -> list[RegressionStats]:
    """The per-head blocks of dense statistics: exactly what a head-matched run accumulates."""
    return [dense.block(head_columns(src, heads, h), head_columns(tgt, heads, h)) for h in range(heads)]


def fit_side_heads(stats: list[RegressionStats], src: Layout, tgt: Layout, k: int, lam: float, rank: int
                   ) -> SideFit:
    """A head-matched fit from per-head statistics (`head_stats`, or accumulated per head)."""
    heads = len(stats)
    sh, th = head_layouts(src, tgt, heads)
    cs = [_centred(s) for s in stats]
    Lt, Ls, Dt = tgt.layers, src.layers, th.width
    sse_single = torch.zeros(Lt, Ls, dtype=torch.float64)
    for j in range(Ls):
        b = sh.block(j)
        for _, _, xx, xy, sst in cs:
            w = _ridge(xx[b, b], xy[b], lam)
            sse_single[:, j] += _sse(w, xx[b, b], xy[b], sst).view(Lt, Dt).sum(1)
    r2_single = 1 - sse_single / sum(c[4].view(Lt, Dt).sum(1) for c in cs)[:, None]
    k = min(k, Ls)
    n = stats[0].n
    sources, weights, biases, bases, eigs, r2 = [], [], [], [], [], []
    for l in range(Lt):
        chosen = sorted(r2_single[l].topk(k).indices.tolist())
        idx, out = sh.index(chosen), th.block(l)
        blocks, bias, sse, sst_l, vals, vecs = [], [], 0.0, 0.0, [], []
        for h, (mx, my, xx, xy, sst) in enumerate(cs):
            g, c = xx[idx][:, idx], xy[idx, out]
            w = _ridge(g, c, lam)  # (K·Ds, Dt)
            blocks.append(w)
            bias.append(my[out] - mx[idx] @ w)
            sse, sst_l = sse + _sse(w, g, c, sst[out]).sum(), sst_l + sst[out].sum()
            cov = w.T @ g @ w / n
            ev, evec = torch.linalg.eigh((cov + cov.T) / 2)
            vals.append(ev)
            vecs.append(torch.zeros(heads * Dt, Dt, dtype=ev.dtype).index_copy_(
                0, torch.arange(h * Dt, (h + 1) * Dt), evec))  # head h's eigenvectors in the whole row
        ev, order = torch.cat(vals).sort(descending=True)
        sources.append(torch.tensor(chosen))
        weights.append(from_head_blocks(torch.stack(blocks)[None], k)[0])
        biases.append(torch.cat(bias))
        bases.append(torch.cat(vecs, dim=1)[:, order[:rank]])
        eigs.append(ev)
        r2.append(1 - sse / sst_l)
    mean = torch.stack([c[1].view(Lt, Dt) for c in cs], dim=1).reshape(Lt, heads * Dt)
    return SideFit(torch.stack(sources), torch.stack(weights), torch.stack(biases), mean, torch.stack(bases),
                   torch.stack(eigs), torch.stack(r2), r2_single)


def heldout_r2_heads(fit: SideFit, stats: list[RegressionStats], src: Layout, tgt: Layout) -> torch.Tensor:
    """`heldout_r2` of a head-matched fit on per-head held-out statistics, pooled over heads."""
    heads = len(stats)
    sh, th = head_layouts(src, tgt, heads)
    k = fit.sources.shape[1]
    blocks = head_blocks(fit.weight, k, heads)  # (Lt, H, K·Ds, Dt)
    out = torch.empty(tgt.layers, dtype=torch.float64)
    for l in range(tgt.layers):
        idx, blk = sh.index(fit.sources[l].tolist()), th.block(l)
        parts = [_heldout_sse(blocks[l, h], fit.bias[l, h * th.width:(h + 1) * th.width], s, idx, blk)
                 for h, s in enumerate(stats)]
        out[l] = 1 - sum(p[0] for p in parts) / sum(p[1] for p in parts)
    return out
