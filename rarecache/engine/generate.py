"""Greedy and sampled decoding from a filled cache, for a batch of any lengths.

`decode` starts from a cache and the logits of each sequence's last prompt
position, wherever they came from (the model's own prefill or a handoff), so
every path into the target model shares one decoding loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .cache import KVCache
from .runner import Runner


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # empty: the model's own end tokens (via LLM)
    ignore_eos: bool = False  # never stop early (benchmarks, parity tests)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass
class Generation:
    tokens: list[int]  # generated tokens, the stop token excluded
    finish_reason: str  # "stop" or "length"


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,)."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / cfg.temperature).softmax(-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.inference_mode()
def decode(
    runner: Runner, cache: KVCache, logits: torch.Tensor, next_pos: torch.Tensor, cfg: SamplingConfig,
    stop_check: Callable[[list[int]], bool] | None = None,
) -> list[Generation]:
    """Decode from `cache`, given last-prompt logits (B, V) and each row's next position (B,).

    `stop_check(tokens)`, if given, ends a row (reason "stop") once it returns True for the
    tokens generated so far (e.g. a task's final-answer pattern).
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    B = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    reasons = ["length"] * B
    stop = set() if cfg.ignore_eos else set(cfg.stop_token_ids)
    next_pos = next_pos.clone().to(runner.device)
    for step in range(cfg.max_new_tokens):
        tok = sample(logits, cfg, gen)
        for b, t in enumerate(tok.tolist()):
            if done[b]:
                continue
            if t in stop:
                done[b], reasons[b] = True, "stop"
            else:
                out[b].append(t)
                if stop_check is not None and stop_check(out[b]):
                    done[b], reasons[b] = True, "stop"
        if all(done) or step == cfg.max_new_tokens - 1:
            break
        alive = torch.tensor([not d for d in done], device=runner.device)
        pos = torch.where(alive, next_pos, -1)[:, None]  # finished rows become padding
        logits = runner.forward(tok[:, None], pos, cache).logits
        next_pos += 1
    return [Generation(t, r) for t, r in zip(out, reasons)]


def generate(runner: Runner, prompts: list[list[int]], cfg: SamplingConfig) -> list[Generation]:
    """Prefill a batch of prompts (any lengths) and decode each."""
    lengths = torch.tensor([len(p) for p in prompts])
    cache, first = runner.prefill(prompts, max_len=int(lengths.max()) + cfg.max_new_tokens)
    return decode(runner, cache, first.logits, lengths, cfg)
