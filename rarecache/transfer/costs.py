"""What a map costs before it is fitted (calibration statistics memory, map file size, the work of mapping
one token) and what a handoff's recompute costs, every pass counted (`describe_recompute`).

Calibration keeps, per side and per part (fit, held-out), float64 sums over every
source layer's rows against every target layer's (fitting/stats.py): XᵀX is (Ls·ds)² and
XᵀY (Ls·ds)·(Lt·dt) numbers. That grows with the product of both models' depths and
KV widths, so it is printed before a calibration starts, and the docs table the
papers' pairs. A head-matched structure (each target KV head from the same head of
the source layers, CacheBridge) keeps only the per-head blocks: 1/H of both.

A map that reads the tokens costs more than its source rows say. With token inputs every
target layer also reads the target's own layer-0 K and V rows of the token (2·dt more input
columns: the statistics' x and each layer's weight are K·ds + 2·dt wide, `Mapper.extra_width`);
with an exact layer 0 that layer is computed, not predicted. Either way the target's layer-0
q/k/v projection runs once per token (`features.token_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

F64 = 8
BOTH_SIDES = 2  # keys and values


@dataclass(frozen=True)
class PairShape:
    name: str
    src_layers: int
    src_heads: int  # KV heads
    src_head_dim: int
    tgt_layers: int
    tgt_heads: int
    tgt_head_dim: int
    tgt_hidden: int = 0  # the target's hidden size and query heads: what its layer-0 q/k/v projection
    tgt_q_heads: int = 0  # of a token costs (maps that read the tokens); 0: not given

    @classmethod
    def of(cls, source_config, target_config, name: str = "") -> "PairShape":
        s, t = source_config, target_config
        return cls(name, s.num_layers, s.num_kv_heads, s.head_dim, t.num_layers, t.num_kv_heads, t.head_dim,
                   t.hidden_size, t.num_heads)

    @property
    def ds(self) -> int:
        return self.src_heads * self.src_head_dim

    @property
    def dt(self) -> int:
        return self.tgt_heads * self.tgt_head_dim

    @property
    def dx(self) -> int:
        return self.src_layers * self.ds

    @property
    def dy(self) -> int:
        return self.tgt_layers * self.dt


def token_width(p: PairShape, token_inputs: bool) -> int:
    """Input columns a layer reads after its source rows: the token block (the target's own layer-0 K and V
    rows, 2·dt), or none (`Mapper.extra_width`)."""
    return 2 * p.dt if token_inputs else 0


def statistics_bytes(p: PairShape, heldout: bool = True, head_matched: bool = False,
                     token_inputs: bool = False) -> int:
    """Float64 calibration state: both sides, the fit part and (if kept) the held-out part."""
    if head_matched and token_inputs:
        raise ValueError("head-matched maps read no token inputs")
    dx, dy = p.dx + token_width(p, token_inputs), p.dy
    per = dx + 2 * dy + dx * dx + dx * dy  # sx, sy, syy, XᵀX, XᵀY
    if head_matched:
        if p.src_heads != p.tgt_heads:
            raise ValueError("head-matched maps need as many KV heads on both sides")
        h = p.src_heads
        per = dx + 2 * dy + (dx * dx + dx * dy) // h
    return BOTH_SIDES * (2 if heldout else 1) * per * F64


def map_bytes(p: PairShape, k: int, rank: int | None = None, dtype_bytes: int = 2, head_matched: bool = False,
              token_inputs: bool = False) -> int:
    """A top-k map's tensors in `dtype_bytes` per number (2: bf16): weight (K·ds [+ 2·dt] rows per target
    layer), bias, mean, basis, eigenvalues."""
    k = min(k, p.src_layers)
    dt = p.dt
    rank = dt // 8 if rank is None else rank
    weight = p.tgt_layers * (k * p.ds + token_width(p, token_inputs)) * dt // (p.tgt_heads if head_matched else 1)
    rest = p.tgt_layers * (3 * dt + dt * rank)
    return BOTH_SIDES * (weight + rest) * dtype_bytes


def token_rows_flops(p: PairShape) -> int:
    """FLOPs of the target's own layer-0 rows of one token (`features.token_rows`): its q, k and v
    projections (the norm and the embedding lookup are negligible)."""
    if not (p.tgt_hidden and p.tgt_q_heads):
        raise ValueError("the target's hidden size and query heads are needed (PairShape.of gives them)")
    return 2 * p.tgt_hidden * (p.tgt_q_heads * p.tgt_head_dim + 2 * p.dt)


def map_flops(p: PairShape, k: int, head_matched: bool = False, token_inputs: bool = False,
              exact_layer0: bool = False) -> int:
    """FLOPs of mapping one token, both sides (`transfer.fused`): one product per predicted target layer
    over K·ds [+ 2·dt] input columns; an exact layer 0 is no product, and a map that reads the tokens runs
    the target's layer-0 q/k/v of the token (`token_rows_flops`). The rank score's projection is left out."""
    k = min(k, p.src_layers)
    predicted = p.tgt_layers - (1 if exact_layer0 else 0)
    per_layer = 2 * (k * p.ds + token_width(p, token_inputs)) * p.dt // (p.tgt_heads if head_matched else 1)
    own = token_rows_flops(p) if token_inputs or exact_layer0 else 0
    return BOTH_SIDES * predicted * per_layer + own


def describe(p: PairShape, k: int, rank: int | None, heldout: bool = True, head_matched: bool = False,
             token_inputs: bool = False, exact_layer0: bool = False) -> str:
    gib = 1 << 30
    dx = p.dx + token_width(p, token_inputs)
    block = f" incl. the token block 2x{p.dt}" if token_inputs else ""
    line = (f"calibration statistics {statistics_bytes(p, heldout, token_inputs=token_inputs) / gib:.2f} GiB "
            f"float64 (XᵀX {dx}²{block}, XᵀY {dx}x{p.dy}, 2 sides{' x fit+held-out' if heldout else ''}); "
            f"map {map_bytes(p, k, rank, 4, token_inputs=token_inputs) / gib:.3f} GiB float32 / "
            f"{map_bytes(p, k, rank, 2, token_inputs=token_inputs) / gib:.3f} GiB bf16")
    if p.src_heads == p.tgt_heads and p.src_heads > 1 and not token_inputs:
        line += (f"; head-matched: {statistics_bytes(p, heldout, True) / gib:.2f} GiB statistics, "
                 f"{map_bytes(p, k, rank, 2, True) / gib:.3f} GiB map (bf16)")
    if p.tgt_hidden and p.tgt_q_heads:
        flops = map_flops(p, k, head_matched, token_inputs, exact_layer0)
        own = (f", of which {token_rows_flops(p) / 1e6:.2f} the target's layer-0 q/k/v"
               if token_inputs or exact_layer0 else "")
        line += f"; mapping a token {flops / 1e6:.2f} MFLOP{own}"
    return line + ("; this run: head-matched" if head_matched else "; this run: dense")


def position_flops(cfg, keys: int) -> int:
    """FLOPs of one position through every layer of a model with config `cfg` (models/config.py), its query
    reading `keys` keys: the q/k/v, output and gated-MLP products and the attention scores and sum."""
    h, d = cfg.hidden_size, cfg.head_dim
    linear = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * (2 * linear + 4 * cfg.num_heads * d * keys)


def recompute_flops(cfg, positions: list[int]) -> int:
    """FLOPs of recomputing `positions` (each reading the keys up to its own)."""
    return sum(position_flops(cfg, p + 1) for p in positions)


def describe_recompute(cfg, length: int, chosen: list[int], first: list[int] | None = None) -> str:
    """What a handoff of a `length`-position prompt recomputed, every pass counted: a two-pass selector's
    first pass (`first`, the newest positions) and its second (`chosen`, which holds them again), against the
    target's own prefill of the prompt (`cfg`: the target's config). A refining variant lists its window
    twice in `first` (pass 1's and the refining pass's)."""
    first = first or []
    own = recompute_flops(cfg, list(range(length)))
    spent = recompute_flops(cfg, chosen) + recompute_flops(cfg, first)
    count = len(chosen) + len(first)
    w = len(set(first))
    if first and len(first) > w:
        how = (f"3 passes, {len(first)} + {len(chosen)} = {count} of {length} positions: pass 1 the newest {w}, "
               f"a refining pass those again and part of {len(chosen) - w} the question reads, the last pass "
               f"those {w} again and the rest")
    elif first:
        how = (f"2 passes, {len(first)} + {len(chosen)} = {count} of {length} positions: pass 1 the newest "
               f"{len(first)}, pass 2 those again and {len(chosen) - len(first)} the question reads")
    else:
        how = f"1 pass, {count} of {length} positions"
    return f"recomputed {how}; {spent / own:.3f} of the target's prefill FLOPs ({spent / 1e9:.2f} GFLOP)"
