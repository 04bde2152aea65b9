"""One loaded model with its tokenizer: the object most callers want.

`LLM("qwen2.5-coder-1.5b-instruct")` resolves a model name (pulling it on first
use), a local HF directory or a GGUF file, loads the weights and the tokenizer,
and generates text for a batch of prompts or chat conversations.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..dtypes import dtype_name
from ..errors import RarecacheError
from ..models.store import resolve_model
from ..models.tokenizer import Tokenizer
from .generate import SamplingConfig, decode
from .runner import Runner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Prompt = str | list[dict[str, Any]]  # raw text, or chat messages rendered by the template


def generation_eos(path: Path, config) -> tuple[int, ...]:
    """A checkpoint's end tokens: its config's and generation_config.json's (checked: the file is data)."""
    ids = list(config.eos_token_ids)
    file = path / "generation_config.json"
    if file.is_file():
        try:
            raw = json.loads(file.read_text())
        except (ValueError, RecursionError) as e:
            raise RarecacheError(f"{file} is not valid JSON: {str(e)[:200]}") from None
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if any(type(i) is not int or i < 0 for i in ids):
        raise RarecacheError(f"{file}: eos_token_id must be integers >= 0, not {ids!r}"[:300])
    return tuple(ids)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str


class LLM:
    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 cache_dir: Path | None = None):
        if isinstance(dtype, str):  # a name, or "auto": what this machine runs fast (dtypes.py)
            dtype = DTYPES[dtype_name(dtype, device)]
        self.path = resolve_model(str(model), cache_dir=cache_dir)
        self.runner = Runner.load(self.path, dtype=dtype, device=device)
        self.config = self.runner.config
        self.tokenizer = Tokenizer.from_dir(self.path, extra_eos=self._generation_eos())
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise RarecacheError(f"{self.path}: tokenizer has {self.tokenizer.vocab_size} tokens, "
                                 f"the model only {self.config.vocab_size}")
        self.runner.learn_lines(self.tokenizer)

    def _generation_eos(self) -> tuple[int, ...]:
        return generation_eos(self.path, self.config)

    def encode(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode_chat(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise RarecacheError("the prompt is empty")
        return ids

    def check_fits(self, prompt_tokens: int, new_tokens: int, name: str = "the model") -> None:
        """Refuse a prompt of `prompt_tokens` plus `new_tokens` to generate that would not fit the
        model's positions (`name`: how the error calls the model)."""
        need, limit = prompt_tokens + new_tokens, self.config.max_position_embeddings
        if need > limit:
            raise RarecacheError(f"prompt + max_new_tokens = {need} tokens (prompt {prompt_tokens} + "
                                 f"{new_tokens} new) exceeds {name}'s {limit} positions")

    def with_eos(self, sampling: SamplingConfig) -> SamplingConfig:
        """`sampling`, stopping at the model's end tokens unless it names its own stop tokens."""
        if sampling.stop_token_ids:
            return sampling
        return replace(sampling, stop_token_ids=self.tokenizer.eos_token_ids)

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig = SamplingConfig()) -> list[Completion]:
        """Generate for each prompt (a batch of any lengths); stops at the model's end tokens."""
        ids = [self.encode(p) for p in prompts]
        self.check_fits(max(len(i) for i in ids), sampling.max_new_tokens)
        longest = max(len(i) for i in ids) + sampling.max_new_tokens
        sampling = self.with_eos(sampling)
        t0 = time.perf_counter()
        cache, first = self.runner.prefill(ids, max_len=longest)
        t1 = time.perf_counter()
        gens = decode(self.runner, cache, first.logits, torch.tensor([len(i) for i in ids]), sampling)
        self.timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1}
        return [Completion(self.tokenizer.decode(g.tokens), g.tokens, len(i), g.finish_reason)
                for g, i in zip(gens, ids)]
