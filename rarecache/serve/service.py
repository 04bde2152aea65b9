"""Chat completions for a family of models that share one cache store across models.

A serving API is stateless: every request carries the whole conversation. The
service keeps, per model, the caches of recent token sequences (a prefix cache)
and answers a request from the best of two starting points: the requested model's
own longest matching prefix, or a longer prefix held by another model of the pair
with a map into the requested one. In the second case the conversation is handed
off (map + selective recompute) instead of being re-read, which is the point of
rarecache: a router can move a conversation between models at every turn.

An entry whose whole sequence is a prefix of the request is extended in place (the
usual next turn of a conversation); an entry that only shares part of it (another
conversation with the same system prompt, a regenerated answer) is copied up to the
shared prefix, so concurrent conversations never overwrite each other's rows.
Entries are evicted least recently used once their caches exceed the byte budget.
One request runs at a time (a lock): on a CPU both cores go to it anyway.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import Held, check_room, common_prefix, respond
from ..transfer.handoff import HandoffConfig
from ..transfer.mapper import Mapper

ROLES = ("system", "user", "assistant")
MAX_STOP, MAX_STOP_CHARS = 4, 64  # OpenAI's limit on stop strings; a bound on what is held back


@dataclass(frozen=True)
class ServiceConfig:
    handoff: HandoffConfig = HandoffConfig(rho=0.3)
    cache_bytes: int = 4 << 30  # budget for the held caches of all models together
    max_new_tokens: int = 1024  # the most one request may ask for
    max_prompt_chars: int = 200_000  # checked before tokenising


class ModelNotFound(RarecacheError):
    pass


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


@dataclass
class _Entry:
    held: Held
    used: float = 0.0


class ChatService:
    def __init__(self, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper],
                 cfg: ServiceConfig = ServiceConfig()):
        for (a, b), mapper in maps.items():
            if a not in models or b not in models:
                raise RarecacheError(f"map {a} -> {b} names a model the service does not have")
            mapper.check_pair(models[a].runner, models[b].runner)
        self.models, self.maps, self.cfg = models, maps, cfg
        self.entries: dict[str, list[_Entry]] = {name: [] for name in models}
        self.lock = threading.Lock()

    # -- the store --------------------------------------------------------------------------

    def _best(self, model: str, ids: list[int]) -> tuple[_Entry | None, int]:
        best, n = None, 0
        for e in self.entries[model]:
            k = common_prefix(e.held.ids, ids)
            if k > n:
                best, n = e, k
        return best, n

    def _claim(self, model: str, entry: _Entry | None, shared: int) -> _Entry:
        """The entry to answer from: `entry` itself when the request extends all of it, else a new
        entry with a copy of its first `shared` rows (or an empty one)."""
        if entry is not None and shared == len(entry.held.ids):
            return entry
        held = Held()
        if entry is not None and shared > 0:
            held.room(self.models[model].runner, shared).copy_prefix(entry.held.cache, shared)
            held.ids = entry.held.ids[:shared]
        new = _Entry(held)
        self.entries[model].append(new)
        return new

    def _evict(self, keep: set[int]) -> None:
        entries = [(e.used, name, e) for name, es in self.entries.items() for e in es]
        total = sum(e.held.nbytes for _, _, e in entries)
        for _, name, e in sorted(entries, key=lambda t: t[0]):
            if total <= self.cfg.cache_bytes:
                break
            if id(e) in keep:
                continue
            total -= e.held.nbytes
            self.entries[name].remove(e)

    def held_bytes(self) -> int:
        return sum(e.held.nbytes for es in self.entries.values() for e in es)

    # -- requests ----------------------------------------------------------------------------

    def validate(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig) -> None:
        if model not in self.models:
            raise ModelNotFound(f"unknown model {model!r}; this server has {', '.join(self.models)}")
        if not messages:
            raise RarecacheError("messages is empty")
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise RarecacheError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content")
        if messages[-1]["role"] == "assistant":
            raise RarecacheError("the last message is the assistant's; there is nothing to answer")
        if sum(len(m["content"]) for m in messages) > self.cfg.max_prompt_chars:
            raise RarecacheError(f"the messages exceed {self.cfg.max_prompt_chars} characters")
        if sampling.max_new_tokens > self.cfg.max_new_tokens:
            raise RarecacheError(f"max_tokens is at most {self.cfg.max_new_tokens} on this server")

    def prepare(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                stop: tuple[str, ...] = ()) -> list[int]:
        """Validate a request and tokenise it: every mistake a client can make is raised here,
        before any work is queued (a streamed answer has no way to report one later)."""
        self.validate(model, messages, sampling)
        if len(stop) > MAX_STOP or any(not 0 < len(x) <= MAX_STOP_CHARS for x in stop):
            raise RarecacheError(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
        ids = self.models[model].encode([{"role": m["role"], "content": m["content"]} for m in messages])
        check_room(self.models[model], model, len(ids), sampling.max_new_tokens)
        return ids

    def complete(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                 stop: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Reply:
        """Answer the conversation `messages` with `model` (greedy unless sampling says otherwise).

        `stop`: strings that end the answer (left out of it). `on_text(piece)` is called with each
        new piece of the answer as it is decoded (streaming): never half a character, never the
        start of what may become a stop string. `cancelled()` returning True ends decoding early
        (a client that went away), which frees the service for the next request.
        """
        return self.answer(model, self.prepare(model, messages, sampling, stop), sampling, stop, on_text, cancelled)

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...] = (),
               on_text: Callable[[str], None] | None = None,
               cancelled: Callable[[], bool] | None = None) -> Reply:
        """`complete` for a prompt `prepare` has already checked and tokenised."""
        tokenizer = self.models[model].tokenizer
        hold = max((len(x) for x in stop), default=1) - 1  # characters that may start a stop string
        sent = 0

        def cut(text: str) -> int | None:
            hits = [text.find(x) for x in stop if x in text]
            return min(hits) if hits else None

        def check(toks: list[int]) -> bool:
            nonlocal sent
            text = tokenizer.decode(toks)
            end = cut(text)
            if on_text is not None:
                shown = end if end is not None else min(len(text.rstrip("\ufffd")), len(text) - hold)
                if shown > sent:
                    on_text(text[sent:shown])
                    sent = shown
            return end is not None or (cancelled is not None and cancelled())

        t = time.perf_counter()
        with self.lock:
            waited = time.perf_counter() - t
            own, own_n = self._best(model, ids)
            keep = min(own_n, len(ids) - 1)
            source, src, src_n = None, None, 0
            for other in self.models:
                if other != model and (other, model) in self.maps:
                    e, n = self._best(other, ids)
                    if e is not None and n > max(keep, src_n):
                        source, src, src_n = other, e, n
            held = {model: self._claim(model, own, own_n)}
            if source is not None:
                held[source] = self._claim(source, src, src_n)
            now = time.monotonic()
            for e in held.values():
                e.used = now
            try:
                gen, kept, result, seconds = respond(
                    self.models, self.maps, self.cfg.handoff, sampling, model, ids,
                    {k: e.held for k, e in held.items()}, source,
                    check if stop or on_text is not None or cancelled is not None else None)
            finally:
                for name, e in held.items():  # a failed request leaves nothing behind
                    if not e.held.ids:
                        self.entries[name].remove(e)
                self._evict({id(e) for e in held.values()})
        text = tokenizer.decode(gen.tokens)
        end, reason = cut(text), gen.finish_reason
        if end is not None:
            text, reason = text[:end], "stop"
        if on_text is not None and len(text) > sent:
            on_text(text[sent:])
        return Reply(model, text, gen.tokens, reason, len(ids), kept, source,
                     None if result is None else len(result.positions[0]),
                     None if result is None else result.handed_off[0][1] - result.handed_off[0][0],
                     {"queued": waited, **seconds})
