"""`rarecache bench handoff`: phase times of the handoff against the target's own prefill.

For each prompt length T, budget ρ and batch size: the target's prefill of the
prompts and the handoff's map, score and recompute phases are timed in the same
run (one warm-up, then repeats; median and spread); a two-pass selector's recompute
is both its passes, also reported apart (`pass1_ms`, `pass2_ms`; a refining variant's
`refine_ms` too). The source prefill is not counted: in a cascade the source has
already paid it. The FLOP ceiling of seed 000 eq. 11 is printed in its dense-mask
form (ρT x T attention) and its sparse-causal form (½ρT x T), with the fraction of
the sparse ceiling reached.

The rank score's arithmetic runs inside the map phase (`Mapper.apply_scored`), so
"map" includes it and "score" is the choice of positions; map + score is the fixed
cost. The warm-up round also measures each side's peak memory (`bench.memory`):
the prefill's above the weights, and the handoff's, which adds the source cache and
the map it holds to its own peak. `summary` is the file the bench writes.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..defaults import SERVED
from ..engine.runner import Runner
from ..transfer.handoff import HandoffConfig, handoff
from ..transfer.mapper import SIDES, Mapper
from ..transfer.query import timed_passes
from ..transfer.selectors import forward_received
from .memory import Peak, footprint, measure


def layer_params(runner: Runner) -> int:
    """Parameters touched per token by the decoder layers (embeddings and head excluded)."""
    layers = runner.model.model.layers
    return sum(t.numel() for t in [*layers.parameters(), *layers.buffers()])  # packed weights are buffers


def map_params(mapper: Mapper) -> tuple[int, int]:
    """(map weights, rank-disagreement probe weights) over all target layers and sides."""
    return (sum(f.weight.numel() for f in mapper.sides.values()),
            sum(f.basis.numel() for f in mapper.sides.values()))


def ceilings(target: Runner, mapper: Mapper, T: int, rho: float) -> tuple[float, float]:
    """Eq. 11 speed-up ceilings (dense-mask, sparse-causal) at length T and budget ρ."""
    c = target.config
    p_t = layer_params(target)
    p_map, p_probe = map_params(mapper)
    alpha = 4 * c.num_layers * c.num_heads * c.head_dim
    full = 2 * p_t * T + 0.5 * alpha * T * T
    linear = (2 * p_map + 2 * p_probe + 2 * rho * p_t) * T
    return full / (linear + rho * alpha * T * T), full / (linear + 0.5 * rho * alpha * T * T)


@dataclass
class Cell:
    T: int
    rho: float
    batch: int
    prefill: list[float]
    phases: dict[str, list[float]]
    memory: dict[str, float | None]  # MiB: measured peaks and the sizes from the shapes (bench.memory)

    def row(self, target: Runner, mapper: Mapper) -> dict:
        med = {k: statistics.median(v) for k, v in self.phases.items()}
        pre = statistics.median(self.prefill)
        total = med["map"] + med["score"] + med["recompute"]
        dense, sparse = ceilings(target, mapper, self.T, self.rho)
        return {"T": self.T, "rho": self.rho, "batch": self.batch, "prefill_ms": pre * 1e3,
                "prefill_spread_ms": (max(self.prefill) - min(self.prefill)) * 1e3,
                **{f"{k}_ms": v * 1e3 for k, v in med.items()}, "handoff_ms": total * 1e3,
                "handoff_spread_ms": (max(map(sum, zip(*(self.phases[k] for k in ("map", "score", "recompute")))))
                                      - min(map(sum, zip(*(self.phases[k] for k in ("map", "score", "recompute"))))))
                * 1e3,
                "speedup": pre / total, "ceiling_dense": dense, "ceiling_sparse": sparse,
                "of_sparse_ceiling": pre / total / sparse, "map_score_share_of_prefill": (med["map"] + med["score"]) / pre,
                **self.memory}


@torch.inference_mode()
def _source_prefill(source: Runner, prompts: list[list[int]], cfg: HandoffConfig):
    """The source's prefill before the switch (not timed: a cascade paid it already), with the attention its
    last queries give each position captured where the selector reads it (attn-source and its variants: the
    capture is part of that uncounted prefill, as in `handoff`)."""
    if cfg.scorer is None or not cfg.scorer.needs_source_attention:
        return source.prefill(prompts)[0], None
    T = len(prompts[0])
    cache = source.new_cache(len(prompts), T)
    pos = torch.arange(T, device=source.device).expand(len(prompts), T)
    _, attn = forward_received(source, torch.tensor(prompts, device=source.device), pos, cache,
                               torch.full((len(prompts),), T, device=source.device), T, logits_at=None)
    return cache, attn


def time_cell(source: Runner, target: Runner, mapper: Mapper, T: int, rho: float, batch: int,
              repeats: int, seed: int = 0, selector: str = SERVED.selector,
              on_round: Callable[[int, float, float], None] | None = None) -> Cell:
    """`on_round(i, prefill_s, handoff_s)`, if given, hears each round (0: the warm-up), as it ends."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(source.config.vocab_size, target.config.vocab_size)
    prompts = torch.randint(0, vocab, (batch, T), generator=g).tolist()
    cfg = HandoffConfig(rho=rho, selector=selector)
    src_cache, src_attn = _source_prefill(source, prompts, cfg)
    tokens = torch.tensor(prompts, device=target.device)
    pos = torch.arange(T, device=target.device).expand(batch, T)
    passes = timed_passes(cfg.scorer)  # a query-aware selector's passes, timed inside recompute and apart
    cell = Cell(T, rho, batch, [], {k: [] for k in ("map", "score", "recompute", *passes)}, {})
    for side in SIDES:  # the map's tensors in the handoff's dtype, cast once before anything is measured
        mapper.tensors(side, mapper.dtype_for(target), target.device)
    target.forward(tokens[:, :1], pos[:, :1], target.new_cache(batch, 1))  # every weight paged in before measuring
    for i in range(repeats + 1):  # the first round warms up and measures memory (timed rounds do not)
        with (nullcontext(Peak()) if i else measure(target.device)) as pre_mem:
            t = time.perf_counter()
            target.forward(tokens, pos, target.new_cache(batch, T))
            synchronize(target.device)
            prefill = time.perf_counter() - t
        with (nullcontext(Peak()) if i else measure(target.device)) as hand_mem:
            _, _, res = handoff(source, target, mapper, prompts, cfg, source_cache=src_cache,
                                source_kept=[T] * batch, source_attn=src_attn)
            synchronize(target.device)
        if on_round is not None:
            on_round(i, prefill, sum(res.timings[k] for k in ("map", "score", "recompute")))
        if not i:
            sizes = footprint(source, target, mapper, T, batch)
            held = sizes["source_cache_mib"] + sizes["map_mib"]
            cell.memory = {"peak_mem_prefill_mib": pre_mem.mib,
                           "peak_mem_handoff_mib": None if hand_mem.mib is None else hand_mem.mib + held,
                           "peak_mem_handoff_own_mib": hand_mem.mib, **sizes}
            continue
        cell.prefill.append(prefill)
        for k in cell.phases:
            cell.phases[k].append(res.timings[k])
    return cell


SUMMARY_KEYS = ("T", "rho", "batch", "of_sparse_ceiling", "map_score_share_of_prefill", "peak_mem_handoff_mib",
                "peak_mem_prefill_mib")


def summary(rows: list[dict], previous: dict | None = None, **header) -> dict:
    """The bench-handoff summary (`bench handoff --summary`): per cell the share of the sparse ceiling, the fixed cost
    and both peaks (`header`: pair, dtype, threads, ... of the run).

    `previous` (the file as it was): its cells are kept where this run measured no cell of the same
    (T, rho, batch) and it was measured the same way (same header), so a long table can be run in parts;
    another setup's file is replaced whole."""
    cells = [{k: r[k] for k in SUMMARY_KEYS} for r in rows]
    if previous and {k: previous.get(k) for k in header} == header and isinstance(previous.get("rows"), list):
        mine = {(c["T"], c["rho"], c["batch"]) for c in cells}
        kept = [c for c in previous["rows"] if isinstance(c, dict) and set(c) == set(SUMMARY_KEYS)
                and (c["T"], c["rho"], c["batch"]) not in mine]
        cells = sorted(kept + cells, key=lambda c: (c["T"], c["batch"], c["rho"]))
    return {**header, "rows": cells}


def read_summary(path: Path) -> dict | None:
    """The summary file as it is, or None when there is none or it is not a JSON object (then replaced)."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so a wall-clock interval covers them (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
