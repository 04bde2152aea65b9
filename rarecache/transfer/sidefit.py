"""What a fitted map holds for each side (keys, values), and the changes of its form that need no data.

`SideFit` is one side's ridge map for every target layer, `SideMLP` its optional residual MLP, and
`Layout` how the rows they read split into layers. Sharpening (`sharpen` / `unsharpen`: scaling each
layer's centred prediction by R²⁻ᵖ, folded into the weight and bias, fitting/fit.py says why) and a head-matched
weight's blocks (`head_blocks` / `from_head_blocks`: what a file stores) are exact changes of form. They
live here, apart from the fitting (transfer/fitting/), because applying a map and reading its file need
them and nothing that fits one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Layout:
    """How a side's concatenated rows split into layers: (layers, width of one layer's row), and `extra`
    input columns after them that every target layer reads beside its chosen layers (a token-input map's
    block of the target's own layer-0 rows, `features.token_block`)."""

    layers: int
    width: int
    extra: int = 0

    def block(self, layer: int) -> slice:
        return slice(layer * self.width, (layer + 1) * self.width)

    def index(self, layers: list[int]) -> torch.Tensor:
        """The columns a map reading `layers` takes: those layers' rows, then the extra columns."""
        return torch.cat([torch.arange(self.width) + l * self.width for l in layers]
                         + [torch.arange(self.extra) + self.layers * self.width])


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


@dataclass
class SideMLP:
    """One side's residual MLPs, every target layer: out = relu(x W1 + b1) W2 + b2."""

    w1: torch.Tensor  # (Lt, K·ds, h), the input standardisation folded in
    b1: torch.Tensor  # (Lt, h)
    w2: torch.Tensor  # (Lt, h, dt)
    b2: torch.Tensor  # (Lt, dt)

    def residual(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x (N, K·ds) gathered source rows -> the MLP's correction (N, dt)."""
        w1, b1, w2, b2 = (t[layer].to(x.device, x.dtype) for t in (self.w1, self.b1, self.w2, self.b2))
        return torch.relu(torch.addmm(b1, x, w1)) @ w2 + b2

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.mlp.{n}": getattr(self, n) for n in ("w1", "b1", "w2", "b2")}


R2_FLOOR = 0.05  # sharpening never scales a layer by more than R2_FLOOR ** -power


def sharpen(fit: SideFit, power: float) -> SideFit:
    """The fit with each target layer's centred prediction scaled by r2^-power: ŷ' = ȳ + s(ŷ − ȳ), folded
    into the weight and bias (W' = sW, b' = sb + (1 − s)ȳ), so the map applies as before. The
    prediction covariance scales by s² (eigenvalues; the basis is unchanged); `r2` stays the ridge's."""
    if power == 0:
        return fit
    scale = fit.r2.clamp(min=R2_FLOOR) ** -power  # (Lt,)
    return replace(fit, weight=fit.weight * scale[:, None, None],
                   bias=scale[:, None] * fit.bias + (1 - scale[:, None]) * fit.mean,
                   eigenvalues=fit.eigenvalues * scale[:, None] ** 2)


def unsharpen(fit: SideFit, power: float) -> SideFit:
    """The inverse of `sharpen(fit, power)`: the plain ridge fit back, exactly up to rounding (`r2` and
    `mean` are the ridge's in both), so a map's sharpening can be changed without its statistics."""
    if power == 0:
        return fit
    scale = fit.r2.clamp(min=R2_FLOOR) ** -power  # (Lt,)
    return replace(fit, weight=fit.weight / scale[:, None, None],
                   bias=(fit.bias - (1 - scale[:, None]) * fit.mean) / scale[:, None],
                   eigenvalues=fit.eigenvalues / scale[:, None] ** 2)


def head_blocks(weight: torch.Tensor, k: int, heads: int) -> torch.Tensor:
    """A head-matched weight (Lt, K·ds, dt) -> its head blocks (Lt, H, K·Ds, Dt) (what a file stores)."""
    lt, kd, dt = weight.shape
    w = weight.view(lt, k, heads, kd // (k * heads), heads, dt // heads)
    return torch.stack([w[:, :, h, :, h].reshape(lt, -1, dt // heads) for h in range(heads)], dim=1)


def from_head_blocks(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Head blocks (Lt, H, K·Ds, Dt) -> the weight (Lt, K·H·Ds, H·Dt), zero off the blocks."""
    lt, heads, kd_h, dt_h = blocks.shape
    w = blocks.new_zeros(lt, k, heads, kd_h // k, heads, dt_h)
    for h in range(heads):
        w[:, :, h, :, h] = blocks[:, h].view(lt, k, kd_h // k, dt_h)
    return w.view(lt, k * heads * (kd_h // k), heads * dt_h)
