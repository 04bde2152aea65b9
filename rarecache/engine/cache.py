"""A preallocated KV cache written by position.

Slot p of a sequence holds the key and value of the token at position p, whoever
computed it: the model itself, or a map from another model. `filled` says which
slots hold something; attention reads only filled slots at positions <= the
query's. One extra slot at the end absorbs writes from padding tokens (position
-1), so a padded batch needs no special-casing on the hot path.
"""

from __future__ import annotations

import torch

from ..errors import RarecacheError
from ..models.config import ModelConfig


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.max_len = max_len
        shape = (num_layers, batch, num_kv_heads, max_len + 1, head_dim)  # (L, B, Hkv, S+1, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.filled = torch.zeros(batch, max_len + 1, dtype=torch.bool, device=device)  # (B, S+1)

    @classmethod
    def for_model(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, max_len, dtype, device)

    @property
    def batch(self) -> int:
        return self.filled.shape[0]

    def slots(self, positions: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """positions (B, T), -1 for padding -> slot indices (padding -> the spare slot). `top`: the highest
        position when the caller knows it (read on the host once per pass: on a GPU, reading it here would
        wait for the device at every layer)."""
        top = (int(positions.max()) if positions.numel() else -1) if top is None else top
        if top >= self.max_len:
            raise RarecacheError(f"position {top} does not fit a cache of {self.max_len} positions")
        return torch.where(positions >= 0, positions, self.max_len)

    def mark(self, positions: torch.Tensor, top: int | None = None) -> None:
        """Declare the slots at `positions` (B, T) filled."""
        rows = torch.arange(self.batch, device=positions.device)[:, None].expand_as(positions)
        self.filled[rows, self.slots(positions, top)] = True
        self.filled[:, self.max_len] = False

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              top: int | None = None) -> None:
        """Store k, v (B, Hkv, T, D) of `layer` at positions (B, T)."""
        rows = torch.arange(self.batch, device=positions.device)[:, None].expand_as(positions)
        slots = self.slots(positions, top)
        # (B, S, Hkv, D) views write through to the (B, Hkv, S, D) storage
        self.k[layer].transpose(1, 2)[rows, slots] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer].transpose(1, 2)[rows, slots] = v.transpose(1, 2).to(self.v.dtype)

    def layer(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, length, D) of the first `length` slots of `layer`."""
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def row(self, b: int) -> "KVCache":
        """Sequence b as a cache of batch one that shares this cache's storage (writes go through)."""
        view = KVCache.__new__(KVCache)
        view.max_len = self.max_len
        view.k, view.v, view.filled = self.k[:, b : b + 1], self.v[:, b : b + 1], self.filled[b : b + 1]
        return view

    def copy_prefix(self, other: "KVCache", length: int) -> None:
        """Take the first `length` slots of every row from `other` (batch one: broadcast to every row)."""
        self.k[:, :, :, :length] = other.k[:, :, :, :length]
        self.v[:, :, :, :length] = other.v[:, :, :, :length]
        self.filled[:, :length] = other.filled[:, :length]

    def clear(self, start: int) -> None:
        """Forget every slot at positions >= start (their rows will be rewritten before use)."""
        self.filled[:, start:] = False

    def grown(self, max_len: int) -> "KVCache":
        """A copy with room for `max_len` positions (the same one if it already fits)."""
        if max_len <= self.max_len:
            return self
        L, B, H, _, D = self.k.shape
        new = KVCache(L, B, H, D, max_len, self.k.dtype, self.k.device)
        n = self.max_len
        new.k[:, :, :, :n], new.v[:, :, :, :n] = self.k[:, :, :, :n], self.v[:, :, :, :n]
        new.filled[:, :n] = self.filled[:, :n]
        return new
