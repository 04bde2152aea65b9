"""Sufficient statistics of a cross-model regression, accumulated in float64.

For one side (keys or values): x concatenates every source layer's content row,
y every target layer's. Means, XᵀX and XᵀY are all a ridge fit, the R² of any
subset of source layers and the rank-disagreement basis need, so calibration
streams: it never holds all tokens, and it can stop and resume. Sums (not means)
are kept, so adding chunks in the same order gives bit-identical statistics.
"""

from __future__ import annotations

import torch


class RegressionStats:
    def __init__(self, dx: int, dy: int, device: str | torch.device = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.n = 0
        self.sx = torch.zeros(dx, **f64)
        self.sy = torch.zeros(dy, **f64)
        self.syy = torch.zeros(dy, **f64)  # per-dimension sums of squares (R² needs only these)
        self.xx = torch.zeros(dx, dx, **f64)
        self.xy = torch.zeros(dx, dy, **f64)

    def update(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> None:
        """x (N, dx), y (N, dy) rows of the same N tokens; `w` (N,) weighs each token's row (a weighted
        ridge: every sum becomes a weighted sum). Weights should average 1 over the N tokens, so that `n`
        still counts them (calibrate's `attention_weights` normalises them so)."""
        x, y = x.to(self.xx), y.to(self.xx)
        if w is not None and not abs(float(w.double().sum()) - x.shape[0]) <= 1e-6 * x.shape[0]:
            raise ValueError("row weights must average 1 over the rows given (n counts rows)")
        self.n += x.shape[0]
        wx = x if w is None else x * w.to(self.xx)[:, None]  # (N, dx)
        wy = y if w is None else y * w.to(self.xx)[:, None]  # (N, dy)
        self.sx += wx.sum(0)
        self.sy += wy.sum(0)
        self.syy += (wy * y).sum(0)
        self.xx += wx.T @ x
        self.xy += wx.T @ y

    def block(self, ix: torch.Tensor, iy: torch.Tensor) -> "RegressionStats":
        """The statistics of the x columns `ix` against the y columns `iy`: exactly what accumulating
        only those columns would have given (a head-matched map's per-head blocks)."""
        s = RegressionStats.__new__(RegressionStats)
        s.n, s.sx, s.sy, s.syy = self.n, self.sx[ix], self.sy[iy], self.syy[iy]
        s.xx, s.xy = self.xx[ix][:, ix], self.xy[ix][:, iy]
        return s

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        n = torch.tensor([self.n], dtype=torch.int64)
        return {f"{prefix}.n": n, f"{prefix}.sx": self.sx, f"{prefix}.sy": self.sy, f"{prefix}.syy": self.syy,
                f"{prefix}.xx": self.xx, f"{prefix}.xy": self.xy}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> "RegressionStats":
        s = cls.__new__(cls)
        s.n = int(t[f"{prefix}.n"][0])
        for name in ("sx", "sy", "syy", "xx", "xy"):
            # a copy in freshly allocated memory: tensors read from a file sit at whatever offset the
            # file gives them, and float64 BLAS reductions can round differently on unaligned data
            setattr(s, name, t[f"{prefix}.{name}"].clone())
        return s
