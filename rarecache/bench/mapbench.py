"""Time to map a prompt's cache vs the target's own prefill of the same prompt.

Both are timed in the same run on the same prompt, after a warm-up, as the median
of several repeats; the figure that matters is their ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..engine.runner import Runner
from ..transfer.selectors import rank_scores
from ..transfer.mapper import Mapper


@dataclass
class MapTiming:
    length: int
    prefill_s: list[float]  # target's own prefill
    map_s: list[float]  # source cache -> target cache (de-rotate, map, re-rotate, write)
    score_s: list[float]  # rank-disagreement scores from the map's outputs

    def row(self) -> dict:
        p, m, s = (statistics.median(x) for x in (self.prefill_s, self.map_s, self.score_s))
        return {"T": self.length, "prefill_ms": p * 1e3, "map_ms": m * 1e3, "score_ms": s * 1e3,
                "map_over_prefill": m / p, "map_score_over_prefill": (m + s) / p,
                "prefill_spread_ms": (max(self.prefill_s) - min(self.prefill_s)) * 1e3,
                "map_spread_ms": (max(self.map_s) - min(self.map_s)) * 1e3}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.inference_mode()
def time_map(source: Runner, target: Runner, mapper: Mapper, length: int, repeats: int = 3,
             seed: int = 0, on_round: Callable[[int, float, float], None] | None = None) -> MapTiming:
    """`on_round(i, prefill_s, map_s)`, if given, hears each round (0: the warm-up), as it ends."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, min(source.config.vocab_size, 150000), (1, length), generator=g)
    pos = torch.arange(length)[None]
    src_cache = source.new_cache(1, length)
    source.forward(tokens, pos, src_cache, logits_at=None)
    res = MapTiming(length, [], [], [])
    for i in range(repeats + 1):  # the first round warms up
        cache = target.new_cache(1, length)
        prefill = _timed(lambda: target.forward(tokens, pos, target.new_cache(1, length)))
        z = {}
        mapping = _timed(lambda: z.update(mapper.apply(source, src_cache, target, cache, pos, tokens=tokens)))
        scoring = _timed(lambda: rank_scores(mapper, z))
        if on_round is not None:
            on_round(i, prefill, mapping)
        if i:
            res.prefill_s.append(prefill)
            res.map_s.append(mapping)
            res.score_s.append(scoring)
    return res
