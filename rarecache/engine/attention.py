"""Attention with an exact causal rule by position, and the kernel that applies it, chosen by device.

A query at position p sees the cached keys at positions <= p whose slots are
filled, and nothing else. This single rule covers prefill, decode, padded batches
and a recompute over scattered positions against a cache filled by someone else.

A plain prefill uses the causal kernel. Any other query set (the recompute's
scattered positions) goes through the kernel `choose` picks for the device, the one
place that choice is made:
- CPU: query blocks, each attending only to keys up to its highest position, so
  causally invalid pairs are mostly never computed (a dense ρT x T mask would
  evaluate all of them). Neighbouring blocks whose key ranges are close run as one
  call (`query_blocks`): each call has a fixed cost (in bfloat16 the kernel repacks
  the keys per call; 32-query blocks of a 614-query suffix took 2x one dense call),
  so a suffix over a long prefix runs as one masked call.
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
MERGE_SLACK = 0.25  # neighbouring blocks run as one call while it computes at most this share more pairs
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
    """Queries are exactly positions 0..T-1 in every row and their slots are filled. Slots past T (a cache
    allocated longer than the prompt) do not matter: no query sees a key past its own position, so the
    causal kernel over the first T keys is the position rule exactly."""
    T = q_pos.shape[1]
    if filled.shape[1] < T:
        return False
    return bool((q_pos == torch.arange(T, device=q_pos.device)).all()) and bool(filled[:, :T].all())


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
    blocks: tuple[tuple[int, int], ...] = ()  # BLOCKS: each query block's (end, key length), `query_blocks`
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


def query_blocks(host_pos: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The BLOCKS kernel's calls for positions (B, T) on the host: (end of its queries, its key length) each,
    consecutive, covering every query. QUERY_BLOCK blocks (`block_lengths`) are coalesced while one call over
    the longest of their key ranges computes at most MERGE_SLACK more query-key pairs than they would apart."""
    T = host_pos.shape[1]
    calls: list[list[int]] = []  # [start, end, key length, pairs the blocks apart would compute]
    for j, length in enumerate(block_lengths(host_pos)):
        start, end = j * QUERY_BLOCK, min((j + 1) * QUERY_BLOCK, T)
        pairs = (end - start) * length
        if calls:
            s0, _, n0, p0 = calls[-1]
            if (end - s0) * max(n0, length) <= (1 + MERGE_SLACK) * (p0 + pairs):
                calls[-1] = [s0, end, max(n0, length), p0 + pairs]
                continue
        calls.append([start, end, length, pairs])
    return tuple((end, length) for _, end, length, _ in calls)


def prepare(kind: str, q_pos: torch.Tensor, filled: torch.Tensor, host_pos: torch.Tensor | None = None,
            plain: bool | None = None) -> Plan:
    """The plan for queries at q_pos (B, T) over slots filled (B, S) through kernel `kind` (`choose`).
    `host_pos`: q_pos already on the host (None: read here when needed); `plain`: whether this is a plain
    prefill (None: checked here, on the device)."""
    if _is_plain_prefill(q_pos, filled) if plain is None else plain:
        return Plan(CAUSAL)
    if q_pos.shape[1] > QUERY_BLOCK:  # a few queries: one small dense kernel is cheapest anywhere
        if kind == BLOCKS:
            return Plan(BLOCKS, query_blocks(q_pos.cpu() if host_pos is None else host_pos))
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
    if plan.kind == CAUSAL:  # queries 0..T-1: the first T keys (no query sees past its own position)
        T = q.shape[2]
        out = F.scaled_dot_product_attention(q, k[:, :, :T], v[:, :, :T], is_causal=True, enable_gqa=True)
    elif plan.kind == BLOCKS:
        out = attend_blocks(q, q_pos, k, v, filled, plan.blocks)
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


def attend_blocks(q, q_pos, k, v, filled, blocks: tuple[tuple[int, int], ...] | None = None):
    """Sparse-causal: blocks of queries, each over the keys up to its highest position (`blocks`, from
    `query_blocks`; None: read from q_pos here). -> (B, H, T, D)."""
    blocks = query_blocks(q_pos.cpu()) if blocks is None else blocks
    outs, start = [], 0
    for end, length in blocks:  # keys past `length` are never visible to this block
        s = slice(start, end)
        outs.append(attend_dense(q[:, :, s], q_pos[:, s], k[:, :, :length], v[:, :, :length], filled[:, :length]))
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


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
