"""One chat request on its way through the scheduler (`Job`), and what it comes back as (`Reply`).

A job is created by `ChatService` once the request is checked, then touched by the worker thread
only (serve/worker.py): admitted (rows claimed, prompt prefilled or handed off), stepped a token at a
time in a batch, finished. Its fields fall in three groups: the request, the reply handed back, and
what it holds while it runs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.generate import Row, SamplingConfig
from ..transfer.conversation import Started
from .config import Budget
from .store import Entry


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


@dataclass(eq=False)
class Job:
    """One request, from submission to reply; touched by the worker only, once submitted."""

    model: str
    ids: list[int]  # the prompt (continue_final: up to the final message, whose tokens join it once read)
    sampling: SamplingConfig | None  # None: continue_final with no answer (max_tokens 0)
    stop: tuple[str, ...]
    on_text: Callable[[str], None] | None
    cancelled: Callable[[], bool] | None
    salt: str | None = None  # entries are shared only within one salt
    continued: list[int] | None = None  # continue_final: the final assistant message's tokens, read after `ids`
    logprobs: bool = False  # continue_final: score them
    budget: Budget = None  # type: ignore[assignment]  # its handoff budget (request_budget), always given
    submitted: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None
    error: BaseException | None = None
    # while running
    held: dict[str, Entry] = field(default_factory=dict)
    source: str | None = None
    started: Started | None = None
    row: Row | None = None
    sent: int = 0  # characters of the answer already given to on_text
    scored: list[tuple[int, float, int, str]] | None = None  # continue_final with logprobs
    seconds: dict[str, float] = field(default_factory=dict)
    t_decode: float = 0.0
    missed: str | None = None  # why no other model's rows were found to hand off from (outcome.REASONS)
    on_start: Callable[[dict], None] | None = None  # given outcome.fields once the prompt's rows are ready


def cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in text, if any."""
    hits = [text.find(x) for x in stop if x in text]
    return min(hits) if hits else None
