"""Cache rows in position-free content space, and back.

A cache row concatenates all KV heads of one layer at one position (width
n_kv·head_dim). Keys are stored rotated; `rows` strips the model's RoPE at each
position so maps see content only, and `write_rows` re-rotates with the receiving
model's RoPE before writing, so a map fitted on short sequences serves any length.
Every source layer is de-rotated once and shared by all target layers that read it.
"""

from __future__ import annotations

import torch

from ..engine.cache import KVCache
from ..engine.runner import Runner


def rows(runner: Runner, cache: KVCache, positions: torch.Tensor, side: str) -> torch.Tensor:
    """Content rows of every layer at positions (B, T) -> (B, T, L·Hkv·D), layers concatenated."""
    store = cache.k if side == "k" else cache.v  # (L, B, Hkv, S+1, D)
    L, B, H, _, D = store.shape
    slots = cache.slots(positions)  # (B, T)
    idx = slots[None, :, None, :, None].expand(L, B, H, slots.shape[1], D)
    x = store.gather(3, idx)  # (L, B, Hkv, T, D)
    if side == "k":
        x = runner.rope.strip(x, positions)  # one cos/sin per position, broadcast over layers
    return x.permute(1, 3, 0, 2, 4).reshape(B, slots.shape[1], L * H * D)  # (B, T, L·Hkv·D)


def write_rows(runner: Runner, cache: KVCache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write content rows k, v (L, B, T, Hkv·D) of every layer at positions (B, T); keys get RoPE."""
    L, B, T, _ = k.shape
    H, D = runner.config.num_kv_heads, runner.config.head_dim
    k = k.reshape(L, B, T, H, D).transpose(2, 3)  # (L, B, Hkv, T, D)
    k = runner.rope.apply(k.to(cache.k.dtype), positions)  # one cos/sin per position, broadcast over layers
    v = v.reshape(L, B, T, H, D).transpose(2, 3)  # (L, B, Hkv, T, D)
    for layer in range(L):
        cache.write(layer, positions, k[layer], v[layer])
    cache.mark(positions)
