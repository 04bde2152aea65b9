"""Slow, plainly correct versions of fast paths, for tests to compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rarecache.engine.cache import KVCache
from rarecache.engine.runner import Runner


def continuation_logprobs_reference(runner: Runner, cache: KVCache, first: torch.Tensor, start: int,
                                    continuations: list[list[int]]) -> list[list[float]]:
    """One context (cache of batch one, `first` (V,)), one continuation at a time over that one
    cache: the reference for `rarecache.eval.scoring.continuation_logprobs`."""
    cache = cache.grown(start + max(len(c) for c in continuations))
    out = []
    for cont in continuations:
        logits = first[None]
        if len(cont) > 1:
            toks = torch.tensor([cont[:-1]], device=runner.device)
            pos = torch.arange(start, start + len(cont) - 1, device=runner.device)[None]
            logits = torch.cat([logits, runner.forward(toks, pos, cache, logits_at="all").logits[0]])
        lp = F.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont, device=logits.device)[:, None])
        out.append(lp[:, 0].tolist())
    return out
