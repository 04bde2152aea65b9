"""Attention with an exact causal rule by position, and the kernel that applies it, chosen by device.

A query at position p sees the cached keys at positions <= p whose slots are
filled, and nothing else. This single rule covers prefill, decode, padded batches
and a recompute over scattered positions against a cache filled by someone else.

A plain prefill uses the causal kernel. Any other query set (the recompute's
scattered positions) goes through the kernel `choose` picks for the device, the one
place that choice is made:
- CPU: query blocks, each attending only to keys up to its highest position, so
  causally invalid pairs are mostly never computed (a dense ρT x T mask would
  evaluate all of them).
- CUDA: FlexAttention (torch.nn.attention.flex_attention, compiled) with a position
  mask, so the same skipping happens inside one fused kernel (the blocks were many
  small launches there, 3.4x slower than one dense-mask kernel on an H200,
  docs/PERFORMANCE.md). If it fails to compile, the failure is recorded (`FAILURES`)
  and every later pass takes the dense mask.
What a kernel needs about a pass's positions (block lengths, the block mask, the dense
mask) is built once per pass by `prepare` (a `Plan`), from positions already read on
the host, so no layer reads the device. `attend_dense` is the reference every path is
tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_BLOCK = 32  # queries per block on the CPU's path (smaller blocks skip more invalid pairs)
CAUSAL, BLOCKS, FLEX, DENSE = "causal", "blocks", "flex", "dense"  # the kernels a Plan names
FAILURES: list[str] = []  # FlexAttention failures on this process (then the dense mask takes over)


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


def attend_reference(q, q_pos, k, v, filled, capture_rows=None, plain=None, plan=None):
    """`attend` with the dense-mask path only (the RaReCache paper's implementation), for comparisons."""
    out = attend_dense(q, q_pos, k, v, filled)
    return out, (attention_probs(q, q_pos, k, filled, capture_rows) if capture_rows is not None else None)


def _is_plain_prefill(q_pos: torch.Tensor, filled: torch.Tensor) -> bool:
    """Queries are exactly positions 0..T-1 in every row and those are the only keys."""
    T = q_pos.shape[1]
    if filled.shape[1] != T:
        return False
    return bool((q_pos == torch.arange(T, device=q_pos.device)).all()) and bool(filled.all())


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def choose(device) -> str:
    """The kernel for scattered queries on `device`: the one place it is chosen."""
    kind = torch.device(device).type
    if kind == "cpu":
        return BLOCKS
    if kind == "cuda" and flex_available() and not FAILURES:
        return FLEX
    return DENSE


@dataclass(frozen=True)
class Plan:
    """What one pass's attention needs about its positions, built once before its layers (`prepare`)."""

    kind: str  # CAUSAL, BLOCKS, FLEX or DENSE
    lengths: tuple[int, ...] = ()  # BLOCKS: each query block's key length
    mask: torch.Tensor | None = None  # DENSE: (B, 1, T, S)
    block_mask: object | None = None  # FLEX: its BlockMask


def block_lengths(host_pos: torch.Tensor) -> tuple[int, ...]:
    """Per QUERY_BLOCK queries of positions (B, T) on the host: the keys any of them may see (at least 1)."""
    B, T = host_pos.shape
    n = -(-T // QUERY_BLOCK)
    padded = torch.full((B, n * QUERY_BLOCK), -1, dtype=host_pos.dtype)
    padded[:, :T] = host_pos
    top = padded.view(B, n, QUERY_BLOCK).amax(dim=(0, 2))  # (n,)
    return tuple((top + 1).clamp(min=1).tolist())


def prepare(kind: str, q_pos: torch.Tensor, filled: torch.Tensor, host_pos: torch.Tensor | None = None,
            plain: bool | None = None) -> Plan:
    """The plan for queries at q_pos (B, T) over slots filled (B, S) through kernel `kind` (`choose`).
    `host_pos`: q_pos already on the host (None: read here when needed); `plain`: whether this is a plain
    prefill (None: checked here, on the device)."""
    if _is_plain_prefill(q_pos, filled) if plain is None else plain:
        return Plan(CAUSAL)
    if q_pos.shape[1] > QUERY_BLOCK:  # a few queries: one small dense kernel is cheapest anywhere
        if kind == BLOCKS:
            return Plan(BLOCKS, block_lengths(q_pos.cpu() if host_pos is None else host_pos))
        if kind == FLEX and not FAILURES:  # (once it failed, the dense mask: no block mask to build)
            block_mask = _flex_block_mask(q_pos, filled)
            if block_mask is not None:
                return Plan(FLEX, block_mask=block_mask)
    return Plan(DENSE, mask=causal_mask(q_pos, filled)[:, None])


def attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    filled: torch.Tensor,
    capture_rows: torch.Tensor | None = None,
    plain: bool | None = None,
    plan: Plan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D) at q_pos (B, T) over k, v (B, Hkv, S, D) with slots filled (B, S).

    Returns the output (B, H, T, D) and, if `capture_rows` (B, R) indexes query rows,
    their attention probabilities (B, H, R, S) in float32. `plan`: the pass's (`prepare`); None: made
    here for the device's kernel, with `plain` as `prepare` takes it.
    """
    plan = plan or prepare(choose(q.device), q_pos, filled, plain=plain)
    if plan.kind == CAUSAL:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif plan.kind == BLOCKS:
        out = attend_blocks(q, q_pos, k, v, filled, plan.lengths)
    elif plan.kind == FLEX:
        out = _flex(q, k, v, plan.block_mask)
        if out is None:  # it failed to compile (recorded): the dense mask, here and from now on
            out = attend_dense(q, q_pos, k, v, filled)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, enable_gqa=True)
    probs = None
    if capture_rows is not None:
        probs = attention_probs(q, q_pos, k, filled, capture_rows)
    return out, probs


def attend_blocks(q, q_pos, k, v, filled, lengths: tuple[int, ...] | None = None):
    """Sparse-causal: blocks of QUERY_BLOCK queries, each over the keys up to its highest position
    (`lengths`, from `block_lengths`; None: read from q_pos here). -> (B, H, T, D)."""
    lengths = block_lengths(q_pos.cpu()) if lengths is None else lengths
    blocks = []
    for j, length in enumerate(lengths):  # keys past `length` are never visible to this block
        s = slice(j * QUERY_BLOCK, (j + 1) * QUERY_BLOCK)
        blocks.append(attend_dense(q[:, :, s], q_pos[:, s], k[:, :, :length], v[:, :, :length],
                                   filled[:, :length]))
    return torch.cat(blocks, dim=2)


def attend_sparse(q, q_pos, k, v, filled, capture_rows=None, plain=None, plan=None):
    """`attend` with the CPU's query blocks on every device, for comparisons on a GPU."""
    return attend(q, q_pos, k, v, filled, capture_rows, plan=prepare(BLOCKS, q_pos, filled, plain=plain))


def attend_flex(q, q_pos, k, v, filled, capture_rows=None, plain=None, plan=None):
    """`attend` through FlexAttention on every device (eager off CUDA: slow, for tests), for comparisons."""
    return attend(q, q_pos, k, v, filled, capture_rows, plan=prepare(FLEX, q_pos, filled, plain=plain))


# -- FlexAttention ---------------------------------------------------------------------------------

_COMPILED: dict[str, object] = {}  # device type -> compiled flex_attention (CUDA); eager elsewhere


def _flex_block_mask(q_pos: torch.Tensor, filled: torch.Tensor):
    """The position rule as FlexAttention's BlockMask (blocks of keys past every query's position are
    skipped whole); None where FlexAttention is missing."""
    if not flex_available():
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, qi, ki):  # causal_mask, one element at a time
        p = q_pos[b, qi]
        return ((ki <= p) & filled[b, ki]) | (p < 0)

    B, T = q_pos.shape
    return create_block_mask(allowed, B, None, T, filled.shape[1], device=q_pos.device)


def _flex(q, k, v, block_mask):
    """FlexAttention over the block mask -> (B, H, T, D); None if it failed (recorded in FAILURES)."""
    from torch.nn.attention.flex_attention import flex_attention

    if FAILURES:  # failed once in this process: not tried again (each try would compile again)
        return None
    fn = flex_attention
    if q.device.type == "cuda":
        fn = _COMPILED.setdefault("cuda", torch.compile(flex_attention))
    try:
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 -- any compile or kernel failure: fall back, recorded
        FAILURES.append(f"flex_attention on {q.device.type} {tuple(q.shape)}: {type(e).__name__}: "
                        f"{' '.join(str(e).split())}"[:300])
        return None


def attention_probs(q, q_pos, k, filled, rows: torch.Tensor) -> torch.Tensor:
    """Attention probabilities (B, H, R, S), float32, of query rows `rows` (B, R)."""
    B, H, _, D = q.shape
    idx = rows[:, None, :, None].expand(B, H, rows.shape[1], D)
    q_sel = q.gather(2, idx).float()  # (B, H, R, D)
    k_all = k.float().repeat_interleave(H // k.shape[1], dim=1)  # (B, H, S, D)
    scores = q_sel @ k_all.transpose(-1, -2) * D**-0.5  # (B, H, R, S)
    mask = causal_mask(q_pos.gather(1, rows), filled)  # (B, R, S)
    return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
