"""Closed-form map fitting from streamed statistics.

Per target layer and side: the single-source R² of every source layer, the top K
by R², ridge on the centred statistics W = (XᵀX + λI)⁻¹XᵀY with bias b = ȳ − x̄W,
and the rank-disagreement basis V_r, the top-r eigenvectors of the prediction
covariance Σ_ŷ = Wᵀ Σ_xx W (no extra pass over data). All in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stats import RegressionStats


@dataclass(frozen=True)
class Layout:
    """How a side's concatenated rows split into layers: (layers, width of one layer's row)."""

    layers: int
    width: int

    def block(self, layer: int) -> slice:
        return slice(layer * self.width, (layer + 1) * self.width)

    def index(self, layers: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(self.width) + l * self.width for l in layers])


@dataclass
class SideFit:
    """The fitted map of one side for every target layer (float64)."""

    sources: torch.Tensor  # (Lt, K) chosen source layers, ascending
    weight: torch.Tensor  # (Lt, K·ds, dt)
    bias: torch.Tensor  # (Lt, dt)
    mean: torch.Tensor  # (Lt, dt) mean prediction on calibration data (= ȳ); z = ŷ − mean
    basis: torch.Tensor  # (Lt, dt, r) top-r eigenvectors of Σ_ŷ, leading first
    eigenvalues: torch.Tensor  # (Lt, dt) of Σ_ŷ, descending
    r2: torch.Tensor  # (Lt,) in-sample R² of the top-K map
    r2_single: torch.Tensor  # (Lt, Ls) single-source R²


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


def heldout_r2(fit: SideFit, s: RegressionStats, src: Layout, tgt: Layout) -> torch.Tensor:
    """R² (Lt,) of the fitted maps on statistics of data they were not fitted on."""
    out = torch.empty(tgt.layers, dtype=torch.float64)
    for l in range(tgt.layers):
        idx, blk = src.index(fit.sources[l].tolist()), tgt.block(l)
        w, b = fit.weight[l], fit.bias[l]
        g, c, sx, sy = s.xx[idx][:, idx], s.xy[idx, blk], s.sx[idx], s.sy[blk]
        sse = (s.syy[blk].sum() - 2 * (w * c).sum() - 2 * b @ sy + (w * (g @ w)).sum()
               + 2 * b @ (w.T @ sx) + s.n * b @ b)
        out[l] = 1 - sse / (s.syy[blk].sum() - (sy @ sy) / s.n)
    return out
