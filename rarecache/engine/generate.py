"""Greedy and sampled decoding from a filled cache, for a batch of any lengths.

`decode` starts from a cache and the logits of each sequence's last prompt
position, wherever they came from (the model's own prefill or a handoff), so
every path into the target model shares one decoding loop. `Row` is that loop's
bookkeeping for one sequence, a token at a time, for callers that step sequences
held in different caches together (the server's scheduler, via
`Runner.decode_step`).

Sampling is numerically safe for every value `SamplingConfig` accepts, and it refuses
the rest when it is built (before any work starts): a temperature too small to divide
by is greedy (its limit; dividing float32 logits by any larger one cannot overflow), and
the top token always survives top-p, however small top_p is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable

import torch

from ..errors import RarecacheError
from .cache import KVCache
from .runner import Runner

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily, as vLLM's do
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # empty: the model's own end tokens (via LLM)
    ignore_eos: bool = False  # never stop early (benchmarks, parity tests)

    def __post_init__(self):
        def whole(x) -> bool:
            return isinstance(x, Integral) and not isinstance(x, bool)

        def real(x) -> bool:
            return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)

        if not whole(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RarecacheError(f"max_new_tokens must be an integer >= 1, not {self.max_new_tokens!r}")
        if not real(self.temperature) or self.temperature < 0:
            raise RarecacheError(f"temperature must be a finite number >= 0, not {self.temperature!r}")
        if not real(self.top_p) or not 0 < self.top_p <= 1:
            raise RarecacheError(f"top_p must be a number in (0, 1], not {self.top_p!r}")
        if not whole(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise RarecacheError(f"seed must be an integer in [-2**63, 2**64), not {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class Generation:
    tokens: list[int]  # generated tokens, the stop token excluded
    finish_reason: str  # "stop" or "length"
    fed: list[int]  # the tokens whose rows the cache holds (see Row.fed)


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,)."""
    if cfg.greedy:
        return logits.argmax(-1)
    probs = (logits.float() / cfg.temperature).softmax(-1)  # finite: |logit| / GREEDY_BELOW < float32 max
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # drop a token once the mass before it already reaches top_p; the top token always stays
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


class Row:
    """One sequence's decoding state: its tokens so far and whether (and why) it has ended."""

    def __init__(self, cfg: SamplingConfig, stop_check: Callable[[list[int]], bool] | None = None):
        self.cfg, self.stop_check = cfg, stop_check
        self.stop = set() if cfg.ignore_eos else set(cfg.stop_token_ids)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # None while it runs
        self.checked = False  # stop_check ended it
        self._gen: torch.Generator | None = None

    def accept(self, t: int) -> bool:
        """Take the sampled token t; True while the row goes on (t is then to be fed)."""
        if t in self.stop:
            self.finish_reason = "stop"
        else:
            self.tokens.append(t)
            if self.stop_check is not None and self.stop_check(self.tokens):
                self.finish_reason, self.checked = "stop", True
            elif len(self.tokens) == self.cfg.max_new_tokens:
                self.finish_reason = "length"
        return self.finish_reason is None

    def take(self, logits: torch.Tensor) -> bool:
        """Sample from this row's own logits (1, V) with its own generator (the same draws as
        `decode` of this row alone) and accept the token."""
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.cfg.seed)
        return self.accept(int(sample(logits, self.cfg, self._gen)[0]))

    @property
    def fed(self) -> list[int]:
        """The generated tokens whose rows are in the cache: all of them when an end token ended
        the row (it is never written), else all but the last (sampled, never fed)."""
        return self.tokens if self.finish_reason == "stop" and not self.checked else self.tokens[:-1]

    def generation(self) -> Generation:
        return Generation(self.tokens, self.finish_reason or "length", self.fed)


@torch.inference_mode()
def decode(
    runner: Runner, cache: KVCache, logits: torch.Tensor, next_pos: torch.Tensor, cfg: SamplingConfig,
    stop_check: Callable[[list[int]], bool] | None = None, on_step: Callable[[], None] | None = None,
) -> list[Generation]:
    """Decode from `cache`, given last-prompt logits (B, V) and each row's next position (B,).

    `stop_check(tokens)`, if given, ends a row (reason "stop") once it returns True for the
    tokens generated so far (e.g. a task's final-answer pattern). `on_step()`, if given, is called
    after each step's forward pass (a progress bar's tick).
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = [Row(cfg, stop_check) for _ in range(logits.shape[0])]
    next_pos = next_pos.clone().to(runner.device)
    while True:
        tok = sample(logits, cfg, gen)  # one draw for the batch
        for row, t in zip(rows, tok.tolist()):
            if row.finish_reason is None:
                row.accept(t)
        alive = torch.tensor([r.finish_reason is None for r in rows], device=runner.device)
        if not alive.any():
            break
        pos = torch.where(alive, next_pos, -1)[:, None]  # finished rows become padding
        logits = runner.forward(tok[:, None], pos, cache).logits
        next_pos += 1
        if on_step is not None:
            on_step()
    return [r.generation() for r in rows]


def generate(runner: Runner, prompts: list[list[int]], cfg: SamplingConfig) -> list[Generation]:
    """Prefill a batch of prompts (any lengths) and decode each."""
    lengths = torch.tensor([len(p) for p in prompts])
    cache, first = runner.prefill(prompts, max_len=int(lengths.max()) + cfg.max_new_tokens)
    return decode(runner, cache, first.logits, lengths, cfg)
