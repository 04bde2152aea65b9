"""Which KV heads a tensor-parallel rank holds, and rows split into per-rank pieces and joined back.

The groundwork for tensor parallelism (docs/VLLM.md, "Tensor parallel"). With TP each rank's
paged cache holds only its own KV heads, so the plan is: capture files one piece per rank
with its head range, and a reader joins the pieces into whole rows, so a stored entry does
not depend on the writer's TP size; the map reads and writes whole rows on every rank, and
each rank then keeps its own heads' columns (`rank_columns`). Rows a rank computes itself (a
map's token block: the target's layer-0 rows, `transfer.features.token_rows`) come out with
its heads only, and are joined the same way after an all-gather (`join_gathered`). This module
is that bookkeeping and nothing else: pure tensor code, no vllm import, no engine.

The rule is vLLM's own (0.32): `QKVParallelLinear.__init__` in
vllm/model_executor/layers/linear.py sets, for tp_size ranks and H KV heads,

    tp_size >= H: num_kv_heads = 1, num_kv_head_replicas = divide(tp_size, H)
    otherwise:    num_kv_heads = divide(H, tp_size), num_kv_head_replicas = 1

and its weight loaders (`QKVParallelLinear.weight_loader`, `_ColumnvLLMParameter.load_qkv_weight`
in vllm/model_executor/parameter.py) give rank r the k / v shard number
r // num_kv_head_replicas. So rank r holds heads [s·h, (s+1)·h) with h = num_kv_heads and
s = r // replicas: neighbouring ranks share a replicated head (H = 2 at TP = 4: ranks 0, 1
hold head 0, ranks 2, 3 head 1). `divide` asserts divisibility, so vLLM refuses H = 6 at
TP = 4 (and H = 3 at TP = 4); `ModelConfig.get_num_kv_heads` in vllm/config/model.py
(max(1, H // tp_size)) checks nothing and agrees with the layer wherever the layer builds.

Rows here are the map's layout: (..., Hkv·D), head-major (column = head·D + d), one layer's
K or V per row, as `transfer.features.write_rows` reads them. The row store's (L, Hkv, n, D)
is one `permute(0, 2, 1, 3).reshape(L, n, Hkv·D)` away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ....errors import RarecacheError


@dataclass(frozen=True)
class HeadRange:
    """The KV heads [start, stop) one rank holds, and how many ranks hold these same heads."""

    start: int
    stop: int
    replicas: int = 1  # tp_size // num_kv_heads when num_kv_heads < tp_size, else 1

    @property
    def count(self) -> int:
        return self.stop - self.start

    def columns(self, head_dim: int) -> slice:
        """This range's columns of a row (..., Hkv·D)."""
        return slice(self.start * head_dim, self.stop * head_dim)


@dataclass(frozen=True)
class Piece:
    """One rank's share of rows: its heads, and their columns (..., heads.count·D)."""

    heads: HeadRange
    rows: torch.Tensor


def _positive(value: Any, what: str) -> int:
    if type(value) is not int or value < 1:
        raise RarecacheError(f"{what} must be a positive integer, not {value!r}"[:200])
    return value


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The KV heads rank `tp_rank` of `tp_size` holds, by vLLM's rule (module docstring)."""
    H = _positive(num_kv_heads, "num_kv_heads")
    tp = _positive(tp_size, "tensor_parallel_size")
    if type(tp_rank) is not int or not 0 <= tp_rank < tp:
        raise RarecacheError(f"tensor-parallel rank {tp_rank!r} is not in [0, {tp})"[:200])
    # as QKVParallelLinear.__init__ (vllm/model_executor/layers/linear.py), which asserts the divisions
    if tp >= H:
        if tp % H:
            raise RarecacheError(f"{H} KV heads do not spread over tensor_parallel_size {tp}: vLLM replicates "
                                 f"heads only when {H} divides {tp} (QKVParallelLinear: divide({tp}, {H}))")
        per_rank, replicas = 1, tp // H
    else:
        if H % tp:
            raise RarecacheError(f"{H} KV heads do not split over tensor_parallel_size {tp}: vLLM needs {tp} to "
                                 f"divide {H} (QKVParallelLinear: divide({H}, {tp}))")
        per_rank, replicas = H // tp, 1
    shard = tp_rank // replicas  # as QKVParallelLinear.weight_loader: tp_rank // num_kv_head_replicas
    return HeadRange(shard * per_rank, (shard + 1) * per_rank, replicas)


def _check_rows(rows: Any, num_kv_heads: int, head_dim: int) -> None:
    H, D = _positive(num_kv_heads, "num_kv_heads"), _positive(head_dim, "head_dim")
    if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or rows.shape[-1] != H * D:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise RarecacheError(f"rows {shape} are not (..., {H}·{D}): {H} KV heads of {D}")


def rank_columns(rows: torch.Tensor, num_kv_heads: int, head_dim: int, tp_size: int,
                 tp_rank: int) -> torch.Tensor:
    """Full rows (..., Hkv·D) -> this rank's heads' columns (..., h·D), a view of `rows`."""
    _check_rows(rows, num_kv_heads, head_dim)
    heads = kv_head_range(num_kv_heads, tp_size, tp_rank)
    return rows[..., heads.columns(head_dim)]  # (..., h·D): heads are whole blocks of D columns


def split_rows(full: torch.Tensor, num_kv_heads: int, head_dim: int, tp_size: int) -> list[Piece]:
    """Full rows (..., Hkv·D) -> one Piece per rank (views of `full`), in rank order. Replicated
    heads appear in each rank's piece; a writer may file only the first of each (tp_rank %
    replicas == 0), since `join_rows` needs each head once."""
    _check_rows(full, num_kv_heads, head_dim)
    _positive(tp_size, "tensor_parallel_size")
    pieces = []
    for rank in range(tp_size):
        heads = kv_head_range(num_kv_heads, tp_size, rank)
        pieces.append(Piece(heads, full[..., heads.columns(head_dim)]))  # (..., h·D)
    return pieces


def join_rows(pieces: list[Piece] | tuple[Piece, ...], num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Pieces of rows from any TP size (any order, replicas allowed) -> full rows (..., Hkv·D).

    The pieces come from files another process wrote, so everything is checked: each head is
    covered, by one range or by identical replicas (equal ranges, equal values), never by
    overlapping ranges; every piece has its range's width and the same leading shape, dtype and
    device. `HeadRange.replicas` is not read (nothing here trusts it)."""
    H, D = _positive(num_kv_heads, "num_kv_heads"), _positive(head_dim, "head_dim")
    if not isinstance(pieces, (list, tuple)) or not pieces:
        raise RarecacheError(f"join_rows needs a non-empty list of Pieces, not {type(pieces).__name__}")
    by_start: dict[int, Piece] = {}
    first = None
    for i, p in enumerate(pieces):
        if not isinstance(p, Piece) or not isinstance(p.heads, HeadRange) or not isinstance(p.rows, torch.Tensor):
            raise RarecacheError(f"piece {i} is not a Piece of a HeadRange and a tensor")
        start, stop, rows = p.heads.start, p.heads.stop, p.rows
        if type(start) is not int or type(stop) is not int or not 0 <= start < stop <= H:
            raise RarecacheError(f"piece {i} claims KV heads [{start!r}, {stop!r}), not a range inside "
                                 f"[0, {H})"[:200])
        if rows.dim() < 1 or rows.shape[-1] != (stop - start) * D:
            raise RarecacheError(f"piece {i} (KV heads [{start}, {stop})) has rows {tuple(rows.shape)}, not "
                                 f"(..., {stop - start}·{D})")
        if first is None:
            first = p
        elif (rows.shape[:-1], rows.dtype, rows.device) != (first.rows.shape[:-1], first.rows.dtype,
                                                            first.rows.device):
            raise RarecacheError(f"piece {i} has rows {tuple(rows.shape)} {rows.dtype} on {rows.device}; piece 0 "
                                 f"{tuple(first.rows.shape)} {first.rows.dtype} on {first.rows.device}: the "
                                 "leading shape, dtype and device must agree")
        seen = by_start.get(start)
        if seen is None:
            by_start[start] = p
        elif seen.heads.stop != stop:
            raise RarecacheError(f"pieces claim KV heads [{start}, {seen.heads.stop}) and [{start}, {stop}): "
                                 "overlapping ranges")
        elif not torch.equal(seen.rows, rows):
            raise RarecacheError(f"two pieces hold KV heads [{start}, {stop}) with different rows: replicas "
                                 "must be identical")
    at = 0
    out = []
    for start in sorted(by_start):
        p = by_start[start]
        if start > at:
            raise RarecacheError(f"KV heads [{at}, {start}) are covered by no piece (of {H})")
        if start < at:
            raise RarecacheError(f"KV heads [{start}, {min(at, p.heads.stop)}) are claimed by overlapping pieces")
        out.append(p.rows)
        at = p.heads.stop
    if at != H:
        raise RarecacheError(f"KV heads [{at}, {H}) are covered by no piece (of {H})")
    return torch.cat(out, dim=-1)  # (..., Hkv·D), heads in order


def join_gathered(every: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Every rank's rows (tp, ..., h·D), stacked in rank order as an all-gather over the TP group
    returns them -> whole rows (..., Hkv·D) (`join_rows`: replicated heads checked identical)."""
    if not isinstance(every, torch.Tensor) or every.dim() < 2:
        shape = tuple(every.shape) if isinstance(every, torch.Tensor) else type(every).__name__
        raise RarecacheError(f"gathered rows {shape} are not (tp, ..., h·D)")
    tp = every.shape[0]
    return join_rows([Piece(kv_head_range(num_kv_heads, tp, r), every[r]) for r in range(tp)], num_kv_heads,
                     head_dim)


__all__ = ["HeadRange", "Piece", "kv_head_range", "rank_columns", "split_rows", "join_rows", "join_gathered"]
