"""One chat request on its way through an engine (`Job`), and what it comes back as (`Reply`).

Both engines' services (serve/contract.py) answer with a `Reply` and run each request as a `Job`: the
request (model, prompt, sampling, stop strings, salt, budget), how its text reaches the client (`show`,
one rule for streaming and stop strings, `cut`) and how its caller waits for it (`done`, `error`). Each
engine extends it with what it holds while it runs: `Scheduled` here (our scheduler, serve/worker.py:
admitted with rows claimed, stepped a token at a time in a batch, finished), the vLLM engine's request
in adapters/vllm/server/engines.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.generate import Row, SamplingConfig
from ..transfer.conversation import Started
from .prefix_store import Entry
from .settings import Budget


@dataclass
class Reply:
    model: str
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    reused: int  # prompt positions whose rows the model already held
    handed_off_from: str | None  # the model whose cache was mapped, if any
    recomputed: int | None  # positions the target recomputed in the handoff
    handed_off: int | None  # positions that came from the map (the recomputed ones included)
    seconds: dict[str, float] = field(default_factory=dict)
    gate: dict | None = None  # the quality gate's decision and why (GateResult.record), if it ran
    rho: float | None = None  # the budget a handoff had: ρ (the gate's rung, 1.0 on a fallback) and selector
    selector: str | None = None
    reused_approximate: int = 0  # of the reused positions, those an earlier handoff left not the model's own
    continued: int = 0  # continue_final: tokens of the final assistant message, the last of `prompt_tokens`
    # continue_final with logprobs: per token of that message, (token, logprob, rank in the vocabulary, its text)
    prompt_logprobs: list[tuple[int, float, int, str]] | None = None
    handoff_status: str | None = None  # serve/outcome.py: applied, fallback_reprefill or unsupported
    fallback_reason: str | None = None  # with fallback_reprefill: why (outcome.REASONS)
    mapper_id: str | None = None  # applied: the id of the map that mapped the rows, where the service knows it


def cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in text, if any."""
    hits = [text.find(x) for x in stop if x in text]
    return min(hits) if hits else None


@dataclass(eq=False, kw_only=True)
class Job:
    """One request, from submission to reply, in either engine (touched by the engine's thread once submitted)."""

    model: str = ""
    ids: list[int] = field(default_factory=list)  # the prompt
    sampling: SamplingConfig | None = None  # None: no answer (continue_final with max_tokens 0; a raw request)
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] | None = None
    salt: str | None = None  # rows are shared only within one salt
    budget: Budget | None = None  # its handoff budget (the service's check_budget)
    mapper: str | None = None  # the map a router named for its handoff (outcome.ROUTER_MAPPER), if any
    submitted: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    sent: int = 0  # characters of the answer already given to on_text

    def show(self, text: str) -> bool:
        """Give on_text what is settled of the answer so far, `text`: never half a character, never the start
        of what may become a stop string. True once a stop string appears."""
        end = cut(text, self.stop)
        if self.on_text is not None:
            hold = max((len(x) for x in self.stop), default=1) - 1  # characters that may start a stop string
            shown = end if end is not None else min(len(text.rstrip("\ufffd")), len(text) - hold)
            if shown > self.sent:
                self.on_text(text[self.sent:shown])
                self.sent = shown
        return end is not None

    def last(self, text: str) -> tuple[str, bool]:
        """The whole answer `text`, cut at its first stop string, with the rest of it given to on_text (an
        on_text that fails is the client's side: kept as the job's `error`); and whether a stop string ended it."""
        end = cut(text, self.stop)
        if end is not None:
            text = text[:end]
        try:
            if self.on_text is not None and len(text) > self.sent:
                self.on_text(text[self.sent:])
                self.sent = len(text)
        except Exception as e:  # noqa: BLE001
            self.error = self.error or e
        return text, end is not None

    def gone(self) -> bool:
        """Whether the client went away."""
        return self.cancelled is not None and self.cancelled()


@dataclass(eq=False, kw_only=True)
class Scheduled(Job):
    """A request in our own engine's scheduler: what it holds while it runs (touched by the worker only)."""

    continued: list[int] | None = None  # continue_final: the final assistant message's tokens, read after `ids`
    logprobs: bool = False  # continue_final: score them
    reply: Reply | None = None
    held: dict[str, Entry] = field(default_factory=dict)
    source: str | None = None
    started: Started | None = None
    row: Row | None = None
    scored: list[tuple[int, float, int, str]] | None = None  # continue_final with logprobs
    seconds: dict[str, float] = field(default_factory=dict)
    t_decode: float = 0.0
    missed: str | None = None  # why no other model's rows were handed off (outcome.REASONS)
    on_start: Callable[[dict], None] | None = None  # given outcome.fields once the prompt's rows are ready
