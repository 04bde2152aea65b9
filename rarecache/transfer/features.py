"""Cache rows in position-free content space, and back.

A cache row concatenates all KV heads of one layer at one position (width
n_kv·head_dim). Keys are stored rotated; `rows` strips the model's RoPE at each
position so maps see content only, and `write_rows` re-rotates with the receiving
model's RoPE before writing, so a map fitted on short sequences serves any length.
Every source layer is de-rotated once and shared by all target layers that read it.

A model's layer-0 rows depend on the token alone (embedding -> input norm -> k/v
projection, no attention), so the target's own layer-0 rows of every handed-off token
can be computed exactly, for a small share of one layer's cost: `token_rows`. A map may
read them as extra input beside the source rows (`token_block`; `calibrate
--token-inputs`) and write them instead of its prediction at layer 0 (`--exact-layer0`).
"""

from __future__ import annotations

import torch

from ..engine.cache import KVCache
from ..engine.runner import AttnCapture, Runner

SIDES = ("k", "v")  # keys and values: every map, statistic and file is per side


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


def features(runner: Runner, ids: list[int], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Prefill one sequence; content rows (N, L·Hkv·D) per side at positions `keep` (what calibration reads)."""
    cache, _ = runner.prefill([ids])
    pos = keep[None].to(runner.device)
    return {s: rows(runner, cache, pos, s)[0] for s in SIDES}


def features_received(runner: Runner, ids: list[int], keep: torch.Tensor, every: int = 4
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`features`, and the attention each position of the sequence receives in the same prefill (T,):
    summed over the queries that read it, averaged over every layer and head. Queries are sampled every
    `every`-th position (and the last), their sum scaled by T / (queries sampled) so that the total stays T,
    to keep the captured probabilities small; `every` 1 reads every query."""
    T = len(ids)
    q = torch.unique(torch.cat([torch.arange(0, T, every), torch.tensor([T - 1])]))  # (R,) sampled queries
    cache = runner.new_cache(1, T)
    cap = AttnCapture(frozenset(range(runner.num_layers)), q[None].to(runner.device))
    out = runner.forward(torch.tensor([ids], device=runner.device), torch.arange(T, device=runner.device)[None],
                         cache, logits_at=None, capture=cap)
    got = sum(p[0].float().sum(dim=(0, 1)) for p in out.attn.values())  # (S,) over heads and sampled queries
    received = got[:T] * (T / len(q)) / (runner.num_layers * runner.config.num_heads)
    pos = keep[None].to(runner.device)
    return {s: rows(runner, cache, pos, s)[0] for s in SIDES}, received


def token_rows(runner: Runner, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The runner's own layer-0 content rows of tokens (B, T) -> side -> (B, T, Hkv·D), in its dtype.

    Exact: the layer's own q/k/v path (norm, projections, biases, Qwen3's k norm) at position 0, where RoPE
    is the identity (cos 1, sin 0), so the keys come out unrotated; no other position is read."""
    B, T = tokens.shape
    h = runner.embed(tokens.clamp(min=0))  # (B, T, C); padding (-1) reads token 0, its rows go unused
    zero = torch.zeros(B, T, dtype=torch.long, device=h.device)
    _, k, v = runner.qkv(0, h, runner.cos_sin(zero))  # (B, Hkv, T, D)
    return {"k": k.transpose(1, 2).reshape(B, T, -1), "v": v.transpose(1, 2).reshape(B, T, -1)}  # (B, T, Hkv·D)


def token_block(own: dict[str, torch.Tensor]) -> torch.Tensor:
    """The input block a token-input map reads beside the source rows, for both sides: the target's own
    layer-0 key and value rows side by side, (..., 2·Hkv·D)."""
    return torch.cat([own["k"], own["v"]], dim=-1)


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
