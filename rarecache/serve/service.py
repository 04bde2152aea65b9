"""Chat completions for a family of models that share one cache store across models.

A serving API is stateless: every request carries the whole conversation. The
service keeps, per model, the caches of recent token sequences (a prefix cache)
and answers a request from the best of two starting points: the requested model's
own longest matching prefix, or a longer prefix held by another model of the pair
with a map into the requested one. In the second case the conversation is handed
off (map + selective recompute) instead of being re-read, which is the point of
rarecache: a router can move a conversation between models at every turn. The
entries, how a request claims one and how they are evicted are in `serve/store.py`.
A request's `salt` (the API's `cache_salt`) scopes both starting points: only entries
written under the same salt are reused or handed off, so tenants with different salts
never read, extend or time each other's rows.

Requests are scheduled continuously: one worker thread admits a waiting request
(its prefill or handoff runs alone, being compute-bound), then advances every
running answer of a model by one token in one batched step (`Runner.decode_step`:
the weights are read once for the whole batch, which is what a decode step costs),
and repeats. An answer joins and leaves the batch at any step; each samples with
its own generator, so it is the answer it would have been alone. All store
operations happen on the worker, so entries need no locks; an entry a running
answer is still writing is copied from, never extended by another request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, get_args

import torch

from ..engine.generate import Row, SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import Started, check_maps, prefill_or_handoff
from ..transfer.gate import GatePolicy
from ..transfer.handoff import HandoffConfig
from ..transfer.mapper import Mapper
from .store import Entry, PrefixStore

Role = Literal["system", "user", "assistant"]  # what a message's role may be (the HTTP front's schema too)
ROLES: tuple[str, ...] = get_args(Role)
MAX_STOP, MAX_STOP_CHARS = 4, 64  # OpenAI's limit on stop strings; a bound on what is held back
MAX_SALT = 1024  # characters of a cache salt


@dataclass(frozen=True)
class ServiceConfig:
    handoff: HandoffConfig = HandoffConfig(rho=0.3)
    gate: GatePolicy | None = None  # hand off through the quality gate (adaptive ρ, fallback) instead
    cache_bytes: int = 4 << 30  # budget for the held caches of all models together
    max_new_tokens: int = 1024  # the most one request may ask for
    max_prompt_chars: int = 200_000  # checked before tokenising
    max_batch: int = 8  # answers decoded together; past it, requests wait for a place

    def __post_init__(self):
        if self.max_batch < 1 or self.cache_bytes <= 0 or self.max_new_tokens < 1:
            raise ValueError("max_batch and max_new_tokens must be >= 1 and cache_bytes > 0")


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
    gate: dict | None = None  # the quality gate's decision and why (GateResult.record), if it ran
    reused_approximate: int = 0  # of the reused positions, those holding mapped rows from an earlier handoff


@dataclass(eq=False)
class _Job:
    """One request, from submission to reply; touched by the worker only, once submitted."""

    model: str
    ids: list[int]
    sampling: SamplingConfig
    stop: tuple[str, ...]
    on_text: Callable[[str], None] | None
    cancelled: Callable[[], bool] | None
    salt: str | None = None  # entries are shared only within one salt
    submitted: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    reply: "Reply | None" = None
    error: BaseException | None = None
    # while running
    held: dict[str, Entry] = field(default_factory=dict)
    source: str | None = None
    started: Started | None = None
    row: Row | None = None
    sent: int = 0  # characters of the answer already given to on_text
    seconds: dict[str, float] = field(default_factory=dict)
    t_decode: float = 0.0


def check_request(models, cfg, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                  stop: tuple[str, ...] = (), salt: str | None = None) -> None:
    """Every mistake a client can make in a chat request, for any engine's service (`cfg` gives
    max_prompt_chars and max_new_tokens; `models` the names served)."""
    if model not in models:
        raise ModelNotFound(f"unknown model {model!r}; this server has {', '.join(models)}")
    if not messages:
        raise RarecacheError("messages is empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RarecacheError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content")
    if messages[-1]["role"] == "assistant":
        raise RarecacheError("the last message is the assistant's; there is nothing to answer")
    if sum(len(m["content"]) for m in messages) > cfg.max_prompt_chars:
        raise RarecacheError(f"the messages exceed {cfg.max_prompt_chars} characters")
    if sampling.max_new_tokens > cfg.max_new_tokens:
        raise RarecacheError(f"max_tokens is at most {cfg.max_new_tokens} on this server")
    if len(stop) > MAX_STOP or any(not isinstance(x, str) or not 0 < len(x) <= MAX_STOP_CHARS for x in stop):
        raise RarecacheError(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_SALT):
        raise RarecacheError(f"cache_salt is a string of 1 to {MAX_SALT} characters")


class ChatService:
    def __init__(self, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper],
                 cfg: ServiceConfig = ServiceConfig()):
        check_maps(models, maps, "the service")
        self.models, self.maps, self.cfg = models, maps, cfg
        self.store = PrefixStore(models, cfg.cache_bytes)  # touched by the worker only
        self.lock = threading.Lock()  # held by the worker while it works (one admission or one step)
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def held_bytes(self) -> int:
        return self.store.nbytes()

    @property
    def load(self) -> tuple[int, int]:
        """(answers running, requests waiting)."""
        return len(self._running), len(self._waiting)

    # -- requests ----------------------------------------------------------------------------

    def prepare(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                stop: tuple[str, ...] = (), salt: str | None = None) -> list[int]:
        """Validate a request and tokenise it: every mistake a client can make is raised here,
        before any work is queued (a streamed answer has no way to report one later)."""
        check_request(self.models, self.cfg, model, messages, sampling, stop, salt)
        ids = self.models[model].encode([{"role": m["role"], "content": m["content"]} for m in messages])
        self.models[model].check_fits(len(ids), sampling.max_new_tokens, model)
        return ids

    def complete(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                 stop: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, salt: str | None = None) -> Reply:
        """Answer the conversation `messages` with `model` (greedy unless sampling says otherwise).

        `stop`: strings that end the answer (left out of it). `on_text(piece)` is called with each
        new piece of the answer as it is decoded (streaming): never half a character, never the
        start of what may become a stop string. `cancelled()` returning True ends decoding early
        (a client that went away), which frees the service for the next request. `salt`: the
        answer reuses (and leaves) cached rows only among requests with the same salt.
        """
        return self.answer(model, self.prepare(model, messages, sampling, stop, salt), sampling, stop, on_text,
                           cancelled, salt)

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...] = (),
               on_text: Callable[[str], None] | None = None,
               cancelled: Callable[[], bool] | None = None, salt: str | None = None) -> Reply:
        """`complete` for a prompt `prepare` has already checked and tokenised: queue it and wait."""
        job = _Job(model, ids, sampling, tuple(stop), on_text, cancelled, salt)
        with self._wake:
            if self._closed:
                raise RarecacheError("the service is closed")
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="rarecache-scheduler", daemon=True)
                self._worker.start()
            self._waiting.append(job)
            self._wake.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.reply

    def close(self) -> None:
        """Stop the worker once the running answers end; waiting requests are refused."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._worker is not None:
            self._worker.join()

    # -- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._running and not (self._waiting or self._closed):
                    self._wake.wait()
                if self._closed and not self._running:
                    for job in self._waiting:
                        self._fail(job, RarecacheError("the service is closed"))
                    self._waiting.clear()
                    return
                job = None
                if self._waiting and len(self._running) < self.cfg.max_batch and not self._closed:
                    job = self._waiting.popleft()
            with self.lock:
                try:
                    if job is not None:
                        self._admit(job)
                    by_model: dict[str, list[_Job]] = {}
                    for j in self._running:
                        by_model.setdefault(j.model, []).append(j)
                    for model, jobs in by_model.items():
                        self._step(model, jobs)
                except Exception as e:  # noqa: BLE001  (a bug of ours: fail what runs, keep serving)
                    for j in [*self._running, *([job] if job is not None and not job.done.is_set() else [])]:
                        self._fail(j, e)

    def _fail(self, job: _Job, error: BaseException) -> None:
        for name, e in job.held.items():  # its rows cannot be trusted: drop its entries
            self.store.drop(name, e)
        if job in self._running:
            self._running.remove(job)
        job.error = error
        job.done.set()

    def _check(self, job: _Job, toks: list[int]) -> bool:
        """After each token: stream what is settled; True once a stop string appears or the client left."""
        text = self.models[job.model].tokenizer.decode(toks)
        end = _cut(text, job.stop)
        if job.on_text is not None:
            hold = max((len(x) for x in job.stop), default=1) - 1  # characters that may start a stop string
            shown = end if end is not None else min(len(text.rstrip("\ufffd")), len(text) - hold)
            if shown > job.sent:
                job.on_text(text[job.sent:shown])
                job.sent = shown
        return end is not None or (job.cancelled is not None and job.cancelled())

    def _admit(self, job: _Job) -> None:
        """Claim the job's entries, prefill or hand off its prompt, take its first token."""
        job.seconds["queued"] = time.perf_counter() - job.submitted
        model, ids = job.model, job.ids
        try:
            if job.cancelled is not None and job.cancelled():  # the client left while it waited
                job.reply = Reply(model, "", [], "stop", len(ids), 0, None, None, None, dict(job.seconds))
                job.done.set()
                return
            own, own_n = self.store.best(model, ids, job.salt)
            keep = min(own_n, len(ids) - 1)
            src, src_n = None, 0
            for other in self.models:
                if other != model and (other, model) in self.maps:
                    e, n = self.store.best(other, ids, job.salt)
                    if e is not None and n > max(keep, src_n):
                        job.source, src, src_n = other, e, n
            job.held[model] = self.store.claim(model, self.models[model].runner, own, own_n, job.salt)
            if job.source is not None:
                job.held[job.source] = self.store.claim(job.source, self.models[job.source].runner, src, src_n,
                                                        job.salt)
            now = time.monotonic()
            for e in job.held.values():
                e.used = now
            job.started = prefill_or_handoff(self.models, self.maps, self.cfg.handoff, job.sampling, model, ids,
                                             {k: e.held for k, e in job.held.items()}, job.source, self.cfg.gate)
        except Exception as e:  # noqa: BLE001  (reported to the request; the worker goes on)
            self._fail(job, e)
            return
        finally:
            if job.source is not None and job.source in job.held:  # the source's part is done
                job.held[job.source].busy = False
            self.store.evict()
        job.seconds["prefill_or_handoff"] = job.started.seconds
        job.t_decode = time.perf_counter()
        checking = job.stop or job.on_text is not None or job.cancelled is not None
        job.row = Row(job.started.sampling, (lambda toks: self._check(job, toks)) if checking else None)
        self._running.append(job)
        self._take(job, job.started.logits)

    def _take(self, job: _Job, logits: torch.Tensor) -> None:
        try:
            going = job.row.take(logits)
        except Exception as e:  # noqa: BLE001  (a failing on_text: the client's side)
            self._fail(job, e)
            return
        if not going:
            self._finish(job)

    def _step(self, model: str, jobs: list[_Job]) -> None:
        """One token for every running answer of `model`, in one batched step."""
        runner = self.models[model].runner
        try:
            tokens = torch.tensor([j.row.tokens[-1] for j in jobs])
            positions = torch.tensor([len(j.ids) + len(j.row.tokens) - 1 for j in jobs])
            logits = runner.decode_step(tokens, positions, [j.started.cache for j in jobs])
        except Exception as e:  # noqa: BLE001
            for j in jobs:
                self._fail(j, e)
            return
        for b, j in enumerate(jobs):
            self._take(j, logits[b : b + 1])

    def _finish(self, job: _Job) -> None:
        model, row = job.model, job.row
        entry = job.held[model]
        entry.held.ids = job.ids + row.fed
        entry.busy = False
        entry.used = time.monotonic()
        self._running.remove(job)
        self.store.evict(tuple(job.held.values()))
        job.seconds["decode"] = time.perf_counter() - job.t_decode
        text = self.models[model].tokenizer.decode(row.tokens)
        end, reason = _cut(text, job.stop), row.finish_reason
        if end is not None:
            text, reason = text[:end], "stop"
        try:
            if job.on_text is not None and len(text) > job.sent:
                job.on_text(text[job.sent:])
        except Exception as e:  # noqa: BLE001
            job.error = e
        result = job.started.handoff
        job.reply = Reply(model, text, row.tokens, reason, len(job.ids), job.started.keep, job.source,
                          None if result is None else len(result.positions[0]),
                          None if result is None else result.handed_off[0][1] - result.handed_off[0][0],
                          dict(job.seconds), None if job.started.gate is None else job.started.gate.record(),
                          job.started.reused_approximate)
        job.done.set()


def _cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in text, if any."""
    hits = [text.find(x) for x in stop if x in text]
    return min(hits) if hits else None
