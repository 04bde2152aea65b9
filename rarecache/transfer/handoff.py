"""The handoff pipeline: source cache -> map -> score -> selective recompute -> target cache.

The target cache starts as the mapped cache at every prompt position. The target
then runs its layers over the selected positions only, at their true positions:
each layer overwrites those rows with its own k, v and attends over the whole
mixed cache by the exact causal rule. The last prompt position is always
selected (it yields the first token's logits) and counts inside the budget.
ρ = 1 reproduces the target's own prefill; ρ = 0 is plain transfer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..engine.cache import KVCache
from ..engine.runner import Runner, pad_batch
from ..errors import RarecacheError
from .mapper import Mapper

SELECTORS = ("rank", "random")


@dataclass(frozen=True)
class HandoffConfig:
    rho: float = 0.0  # share of prompt positions the target recomputes
    selector: str = "rank"
    seed: int = 0  # for the random selector

    def __post_init__(self):
        if not 0 <= self.rho <= 1:
            raise RarecacheError(f"rho must be in [0, 1], got {self.rho}")
        if self.selector not in SELECTORS:
            raise RarecacheError(f"unknown selector {self.selector!r}; choose from {', '.join(SELECTORS)}")


@dataclass
class HandoffResult:
    """What one handoff did, per request."""

    positions: list[list[int]]  # recomputed positions, ascending, per request
    scores: list[torch.Tensor] | None  # per-position selector scores (T,), if the selector has any
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase


def budget(rho: float, length: int) -> int:
    """⌈ρ·T⌉ positions, at least the last one."""
    return max(1, math.ceil(rho * length - 1e-9))


def select_top(scores: torch.Tensor, k: int) -> list[int]:
    """The k highest-scoring positions of scores (T,), the last one forced in; ascending."""
    s = scores.clone().float()
    s[-1] = float("inf")
    return sorted(s.topk(k).indices.tolist())


def rank_scores(mapper: Mapper, z: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rank disagreement s = Σ over target layers and sides of ‖z‖² − ‖z V_r‖², per position (B, T)."""
    total = 0
    for side, zs in z.items():  # zs (Lt, B, T, dt)
        basis = mapper.sides[side].basis.to(zs.device, torch.float32)  # (Lt, dt, r)
        zf = zs.float()
        proj = torch.einsum("lbtd,ldr->lbtr", zf, basis)
        total = total + (zf.square().sum(-1) - proj.square().sum(-1)).sum(0)
    return total  # (B, T)


def subset(tokens: torch.Tensor, chosen: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, T) and ascending positions per row -> their tokens and positions (B, K), -1 padded."""
    width = max(len(c) for c in chosen)
    sel_tokens = torch.zeros(len(chosen), width, dtype=torch.long, device=tokens.device)
    sel_pos = torch.full((len(chosen), width), -1, dtype=torch.long, device=tokens.device)
    for b, c in enumerate(chosen):
        idx = torch.tensor(c, device=tokens.device)
        sel_tokens[b, : len(c)], sel_pos[b, : len(c)] = tokens[b, idx], idx
    return sel_tokens, sel_pos


@torch.inference_mode()
def handoff(source: Runner, target: Runner, mapper: Mapper, prompts: list[list[int]],
            cfg: HandoffConfig = HandoffConfig(), max_len: int | None = None,
            source_cache: KVCache | None = None) -> tuple[KVCache, torch.Tensor, HandoffResult]:
    """Hand a batch of prompts from source to target.

    Returns the target cache (prompt positions filled), the target's logits at each
    prompt's last position (B, V), and the record of what was done.
    """
    timings: dict[str, float] = {}
    tokens, positions = pad_batch(prompts, source.device)
    lengths = [len(p) for p in prompts]
    t = time.perf_counter()
    if source_cache is None:
        source_cache, _ = source.prefill(prompts)
    timings["source_prefill"] = time.perf_counter() - t

    t = time.perf_counter()
    cache = target.new_cache(len(prompts), max_len or max(lengths))
    z = mapper.apply(source, source_cache, target, cache, positions)
    timings["map"] = time.perf_counter() - t

    t = time.perf_counter()
    scores = rank_scores(mapper, z) if cfg.selector == "rank" else None
    chosen = []
    for b, n in enumerate(lengths):
        k = budget(cfg.rho, n)
        if cfg.selector == "rank":
            chosen.append(select_top(scores[b, :n], k))
        else:
            g = torch.Generator().manual_seed(cfg.seed + b)
            chosen.append(select_top(torch.rand(n, generator=g), k))
    timings["score"] = time.perf_counter() - t

    t = time.perf_counter()
    sel_tokens, sel_pos = subset(tokens, chosen)
    out = target.forward(sel_tokens, sel_pos, cache)
    timings["recompute"] = time.perf_counter() - t
    per_request = [scores[b, :n].cpu() for b, n in enumerate(lengths)] if scores is not None else None
    return cache, out.logits, HandoffResult(chosen, per_request, timings)
