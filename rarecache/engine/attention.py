"""Attention with an exact causal rule by position.

A query at position p sees the cached keys at positions <= p whose slots are
filled, and nothing else. This single rule covers prefill, decode, padded batches
and a recompute over scattered positions against a cache filled by someone else.

`attend` is the fast path: a plain prefill uses the causal kernel. On a CPU any other
query set is cut into blocks, each attending only to keys up to its highest
position, so causally invalid query-key pairs are mostly never computed (a dense
ρT x T mask would evaluate all of them). On a GPU the same blocks are many small
launches, and one dense-mask kernel is faster (3.4x on an H200 at T 2048, ρ 0.3,
docs/PERFORMANCE.md), so there it is the dense mask. `attend_dense` is the
reference both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_BLOCK = 32  # queries per block on the sparse-causal path (smaller blocks skip more invalid pairs)


def causal_mask(q_pos: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """q_pos (B, T), filled (B, S) -> allowed (B, T, S)."""
    key_pos = torch.arange(filled.shape[1], device=q_pos.device)
    allowed = (key_pos <= q_pos[..., None]) & filled[:, None, :]
    # padding queries (position -1) see everything: never an all-masked row; their output is discarded
    return allowed | (q_pos < 0)[..., None]


def attend_dense(q, q_pos, k, v, filled):
    """Reference: every query against every key through a dense mask. -> (B, H, T, D)."""
    mask = causal_mask(q_pos, filled)  # (B, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def attend_reference(q, q_pos, k, v, filled, capture_rows=None, plain=None):
    """`attend` with the dense-mask path only (the seed paper's implementation), for comparisons."""
    out = attend_dense(q, q_pos, k, v, filled)
    return out, (attention_probs(q, q_pos, k, filled, capture_rows) if capture_rows is not None else None)


def _is_plain_prefill(q_pos: torch.Tensor, filled: torch.Tensor) -> bool:
    """Queries are exactly positions 0..T-1 in every row and those are the only keys."""
    T = q_pos.shape[1]
    if filled.shape[1] != T:
        return False
    return bool((q_pos == torch.arange(T, device=q_pos.device)).all()) and bool(filled.all())


def attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    filled: torch.Tensor,
    capture_rows: torch.Tensor | None = None,
    plain: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D) at q_pos (B, T) over k, v (B, Hkv, S, D) with slots filled (B, S).

    Returns the output (B, H, T, D) and, if `capture_rows` (B, R) indexes query rows,
    their attention probabilities (B, H, R, S) in float32. `plain`: whether this is a plain
    prefill (queries 0..T-1 in every row over exactly T filled slots), when the caller knows
    (the runner reads it on the host once per pass); None: checked here, on the device.
    """
    T = q.shape[2]
    if _is_plain_prefill(q_pos, filled) if plain is None else plain:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif T <= QUERY_BLOCK or q.device.type != "cpu":
        out = attend_dense(q, q_pos, k, v, filled)
    else:
        out = attend_blocks(q, q_pos, k, v, filled)
    probs = None
    if capture_rows is not None:
        probs = attention_probs(q, q_pos, k, filled, capture_rows)
    return out, probs


def attend_blocks(q, q_pos, k, v, filled):
    """Sparse-causal: blocks of QUERY_BLOCK queries, each over the keys up to its highest position. -> (B, H, T, D)."""
    blocks = []
    for start in range(0, q.shape[2], QUERY_BLOCK):
        qp = q_pos[:, start : start + QUERY_BLOCK]
        length = int(qp.max()) + 1 if bool((qp >= 0).any()) else 1  # keys past this are never visible
        blocks.append(attend_dense(q[:, :, start : start + QUERY_BLOCK], qp, k[:, :, :length],
                                   v[:, :, :length], filled[:, :length]))
    return torch.cat(blocks, dim=2)


def attend_sparse(q, q_pos, k, v, filled, capture_rows=None, plain=None):
    """`attend` with the query blocks on every device (the CPU's path), for comparisons on a GPU."""
    if (_is_plain_prefill(q_pos, filled) if plain is None else plain) or q.shape[2] <= QUERY_BLOCK:
        return attend(q, q_pos, k, v, filled, capture_rows, plain)
    out = attend_blocks(q, q_pos, k, v, filled)
    return out, (attention_probs(q, q_pos, k, filled, capture_rows) if capture_rows is not None else None)


def attention_probs(q, q_pos, k, filled, rows: torch.Tensor) -> torch.Tensor:
    """Attention probabilities (B, H, R, S), float32, of query rows `rows` (B, R)."""
    B, H, _, D = q.shape
    idx = rows[:, None, :, None].expand(B, H, rows.shape[1], D)
    q_sel = q.gather(2, idx).float()  # (B, H, R, D)
    k_all = k.float().repeat_interleave(H // k.shape[1], dim=1)  # (B, H, S, D)
    scores = q_sel @ k_all.transpose(-1, -2) * D**-0.5  # (B, H, R, S)
    mask = causal_mask(q_pos.gather(1, rows), filled)  # (B, R, S)
    return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
