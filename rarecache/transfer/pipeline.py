"""Source model, target model and map as one object that hands prompts off and decodes.

`Pipeline("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "map.safetensors")`
checks the map belongs to this pair and direction, then `generate` runs the source
prefill, the map, the selection and the target's recompute, and decodes with the
target.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM, Completion, Prompt
from ..errors import RarecacheError
from .handoff import HandoffConfig, HandoffResult, handoff
from .mapper import Mapper


class Pipeline:
    def __init__(self, source: str | Path | LLM, target: str | Path | LLM, mapper: str | Path | Mapper,
                 dtype: str = "bfloat16", cache_dir: Path | None = None):
        self.source = source if isinstance(source, LLM) else LLM(source, dtype=dtype, cache_dir=cache_dir)
        self.target = target if isinstance(target, LLM) else LLM(target, dtype=dtype, cache_dir=cache_dir)
        self.mapper = mapper if isinstance(mapper, Mapper) else Mapper.load(mapper)
        if self.source.tokenizer.tokenizer.get_vocab() != self.target.tokenizer.tokenizer.get_vocab():
            raise RarecacheError("source and target tokenizers differ: a handoff needs one family")
        self.mapper.check_pair(self.source.runner, self.target.runner)

    def generate(self, prompts: list[Prompt], cfg: HandoffConfig = HandoffConfig(),
                 sampling: SamplingConfig = SamplingConfig()) -> tuple[list[Completion], HandoffResult]:
        ids = [self.source.encode(p) for p in prompts]
        longest = max(len(i) for i in ids) + sampling.max_new_tokens
        if longest > self.target.config.max_position_embeddings:
            raise RarecacheError(f"prompt + max_new_tokens = {longest} tokens exceeds the target's "
                                 f"{self.target.config.max_position_embeddings}")
        if not sampling.stop_token_ids:
            sampling = replace(sampling, stop_token_ids=self.target.tokenizer.eos_token_ids)
        cache, logits, result = handoff(self.source.runner, self.target.runner, self.mapper, ids, cfg,
                                        max_len=longest)
        t = time.perf_counter()
        gens = decode(self.target.runner, cache, logits, torch.tensor([len(i) for i in ids]), sampling)
        result.timings["decode"] = time.perf_counter() - t
        outs = [Completion(self.target.tokenizer.decode(g.tokens), g.tokens, len(i), g.finish_reason)
                for g, i in zip(gens, ids)]
        return outs, result
