"""Attention with an exact causal rule by position.

A query at position p sees the cached keys at positions <= p whose slots are
filled, and nothing else. This single rule covers prefill, decode, padded batches
and a recompute over scattered positions against a cache filled by someone else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(q_pos: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """q_pos (B, T), filled (B, S) -> allowed (B, T, S)."""
    key_pos = torch.arange(filled.shape[1], device=q_pos.device)
    allowed = (key_pos <= q_pos[..., None]) & filled[:, None, :]
    # padding queries (position -1) see everything: never an all-masked row; their output is discarded
    return allowed | (q_pos < 0)[..., None]


def attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    filled: torch.Tensor,
    capture_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D) at q_pos (B, T) over k, v (B, Hkv, S, D) with slots filled (B, S).

    Returns the output (B, H, T, D) and, if `capture_rows` (B, R) indexes query rows,
    their attention probabilities (B, H, R, S) in float32.
    """
    mask = causal_mask(q_pos, filled)  # (B, T, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    probs = None
    if capture_rows is not None:
        B, H, _, D = q.shape
        idx = capture_rows[:, None, :, None].expand(B, H, capture_rows.shape[1], D)
        q_sel = q.gather(2, idx).float()  # (B, H, R, D)
        k_all = k.float().repeat_interleave(H // k.shape[1], dim=1)  # (B, H, S, D)
        scores = q_sel @ k_all.transpose(-1, -2) * D**-0.5  # (B, H, R, S)
        row_mask = mask.gather(1, capture_rows[..., None].expand(-1, -1, mask.shape[2]))  # (B, R, S)
        probs = scores.masked_fill(~row_mask[:, None], float("-inf")).softmax(-1)
    return out, probs
