"""Source model, target model and map as one object that hands prompts off and decodes.

`Pipeline("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "map.safetensors")`
(models named by a string load in `dtype`; auto: what this machine runs fast, dtypes.py)
checks the map belongs to this pair and direction, then `generate` runs the source
prefill, the map, the selection and the target's recompute for each request, and
decodes the batch with the target. The source's prefill of a prompt is kept for a
few calls, as a cascade would have it already.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engine.cache import KVCache
from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM, Completion, Prompt
from ..errors import RarecacheError
from .handoff import HandoffConfig, HandoffResult, handoff
from .mapper import Mapper

_KEEP = 8  # source prefills remembered


class Pipeline:
    def __init__(self, source: str | Path | LLM, target: str | Path | LLM, mapper: str | Path | Mapper,
                 dtype: str = "auto", cache_dir: Path | None = None):
        self.source = source if isinstance(source, LLM) else LLM(source, dtype=dtype, cache_dir=cache_dir)
        self.target = target if isinstance(target, LLM) else LLM(target, dtype=dtype, cache_dir=cache_dir)
        self.mapper = mapper if isinstance(mapper, Mapper) else Mapper.load(mapper)
        if self.source.tokenizer.tokenizer.get_vocab() != self.target.tokenizer.tokenizer.get_vocab():
            raise RarecacheError("source and target tokenizers differ: a handoff needs one family")
        self.mapper.check_pair(self.source.runner, self.target.runner)
        self._prefills: dict[tuple[int, ...], tuple[KVCache, float]] = {}

    def source_prefill(self, ids: list[int]) -> tuple[KVCache, float]:
        """The source's cache of `ids` and the seconds its prefill took."""
        key = tuple(ids)
        if key not in self._prefills:
            t = time.perf_counter()
            cache, _ = self.source.runner.prefill([ids])
            if len(self._prefills) >= _KEEP:
                self._prefills.pop(next(iter(self._prefills)))
            self._prefills[key] = (cache, time.perf_counter() - t)
        return self._prefills[key]

    def hand_off(self, ids: list[list[int]], cfg: HandoffConfig, rows: list[KVCache]
                 ) -> tuple[torch.Tensor, HandoffResult]:
        """Hand each prompt (token ids) off into its own cache row (`rows`, batch-one caches: e.g. a batch
        cache's `row(b)`), one request at a time (no work on padding). Returns the target's logits at each
        prompt's last position (B, V) and the batch's record (timings summed over the prompts)."""
        sel = cfg.scorer
        reads_source_attention = sel is not None and sel.needs_source_attention
        logits, results = [], []
        for p, row in zip(ids, rows, strict=True):
            src, src_s = (None, 0.0) if reads_source_attention else self.source_prefill(p)
            _, lg, res = handoff(self.source.runner, self.target.runner, self.mapper, [p], cfg, source_cache=src,
                                 source_kept=None if src is None else [len(p)], target_cache=row)
            if src is not None:
                res.timings["source_prefill"] = src_s
            logits.append(lg)
            results.append(res)
        result = HandoffResult([r.positions[0] for r in results],
                               [r.scores[0] for r in results] if results[0].scores is not None else None,
                               [r.handed_off[0] for r in results], results[0].prefix_layers,
                               {k: sum(r.timings[k] for r in results) for k in results[0].timings},
                               [r.first_pass[0] for r in results] if results[0].first_pass else None)
        return torch.cat(logits), result

    def generate(self, prompts: list[Prompt], cfg: HandoffConfig = HandoffConfig(),
                 sampling: SamplingConfig = SamplingConfig()) -> tuple[list[Completion], HandoffResult]:
        ids = [self.source.encode(p) for p in prompts]
        self.target.check_fits(max(len(i) for i in ids), sampling.max_new_tokens, "the target")
        longest = max(len(i) for i in ids) + sampling.max_new_tokens
        sampling = self.target.with_eos(sampling)
        cache = self.target.runner.new_cache(len(ids), longest)
        logits, result = self.hand_off(ids, cfg, [cache.row(b) for b in range(len(ids))])
        t = time.perf_counter()
        gens = decode(self.target.runner, cache, logits, torch.tensor([len(i) for i in ids]), sampling)
        result.timings["decode"] = time.perf_counter() - t
        outs = [Completion(self.target.tokenizer.decode(g.tokens), g.tokens, len(i), g.finish_reason)
                for g, i in zip(gens, ids)]
        return outs, result
