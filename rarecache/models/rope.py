"""Rotary position embedding, evaluated at explicit positions.

Positions are always a tensor, never an implicit offset: a scattered recompute
rotates each token at its true position. `apply` and `strip` are exact inverses
(a rotation by +θ·pos and by −θ·pos), which the transfer package relies on to move
keys between models with different RoPE settings.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), float32, with the config's scaling."""
    freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


class Rope:
    """cos/sin at given positions for one model (computed in float32, like transformers)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu"):
        self.config = rope
        self.head_dim = head_dim
        self.inv_freq = inv_freq(rope, head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int -> cos, sin (B, 1, T, D) in `dtype` (padding positions < 0 are harmless)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        if dtype == torch.float64:  # float64 callers (map fitting, tests) get float64 trigonometry
            emb = emb.double()
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x (..., B, H, T, D) by +θ·pos (leading dims, e.g. layers, share the positions)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return x * cos + rotate_half(x) * sin

    def strip(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo `apply`: rotate x (..., B, H, T, D) by −θ·pos."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return x * cos - rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
