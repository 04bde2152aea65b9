"""What a map costs before it is fitted: calibration statistics memory and map file size.

Calibration keeps, per side and per part (fit, held-out), float64 sums over every
source layer's rows against every target layer's (stats.py): XᵀX is (Ls·ds)² and
XᵀY (Ls·ds)·(Lt·dt) numbers. That grows with the product of both models' depths and
KV widths, so it is printed before a calibration starts, and the docs table the
papers' pairs. A head-matched structure (each target KV head from the same head of
the source layers, CacheBridge) keeps only the per-head blocks: 1/H of both.
"""

from __future__ import annotations

from dataclasses import dataclass

F64 = 8


@dataclass(frozen=True)
class PairShape:
    name: str
    src_layers: int
    src_heads: int  # KV heads
    src_head_dim: int
    tgt_layers: int
    tgt_heads: int
    tgt_head_dim: int

    @classmethod
    def of(cls, source_config, target_config, name: str = "") -> "PairShape":
        s, t = source_config, target_config
        return cls(name, s.num_layers, s.num_kv_heads, s.head_dim, t.num_layers, t.num_kv_heads, t.head_dim)

    @property
    def dx(self) -> int:
        return self.src_layers * self.src_heads * self.src_head_dim

    @property
    def dy(self) -> int:
        return self.tgt_layers * self.tgt_heads * self.tgt_head_dim


def statistics_bytes(p: PairShape, heldout: bool = True, head_matched: bool = False) -> int:
    """Float64 calibration state: both sides, the fit part and (if kept) the held-out part."""
    dx, dy = p.dx, p.dy
    per = dx + 2 * dy + dx * dx + dx * dy  # sx, sy, syy, XᵀX, XᵀY
    if head_matched:
        if p.src_heads != p.tgt_heads:
            raise ValueError("head-matched maps need as many KV heads on both sides")
        h = p.src_heads
        per = dx + 2 * dy + (dx * dx + dx * dy) // h
    return 2 * (2 if heldout else 1) * per * F64


def map_bytes(p: PairShape, k: int, rank: int | None = None, dtype_bytes: int = 2, head_matched: bool = False
              ) -> int:
    """A top-k map's tensors in `dtype_bytes` per number (2: bf16): weight, bias, mean, basis, eigenvalues."""
    k = min(k, p.src_layers)
    dt = p.tgt_heads * p.tgt_head_dim
    ds = p.src_heads * p.src_head_dim
    rank = dt // 8 if rank is None else rank
    weight = p.tgt_layers * k * ds * dt // (p.tgt_heads if head_matched else 1)
    rest = p.tgt_layers * (3 * dt + dt * rank)
    return 2 * (weight + rest) * dtype_bytes


def describe(p: PairShape, k: int, rank: int | None, heldout: bool = True, head_matched: bool = False) -> str:
    gib = 1 << 30
    line = (f"calibration statistics {statistics_bytes(p, heldout) / gib:.2f} GiB float64 "
            f"(XᵀX {p.dx}², XᵀY {p.dx}x{p.dy}, 2 sides{' x fit+held-out' if heldout else ''}); "
            f"map {map_bytes(p, k, rank, 4) / gib:.3f} GiB float32 / {map_bytes(p, k, rank, 2) / gib:.3f} GiB bf16")
    if p.src_heads == p.tgt_heads and p.src_heads > 1:
        line += (f"; head-matched: {statistics_bytes(p, heldout, True) / gib:.2f} GiB statistics, "
                 f"{map_bytes(p, k, rank, 2, True) / gib:.3f} GiB map (bf16)")
    return line + ("; this run: head-matched" if head_matched else "; this run: dense")
