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

A request may also end in an assistant message to be continued (`continue_final`, the API's
`continue_final_message`): the prompt before that message gets its rows as above, then the
model reads the message itself, scoring each of its tokens (the API's `prompt_logprobs`)
and keeping their rows exactly as `Conversation.score` does, so the next turn, on either
model, keeps or hands off from them; with no answer asked (`max_tokens` 0) that is all,
else the answer continues the message.

Requests are scheduled continuously: one worker thread admits a waiting request
(its prefill or handoff runs alone, being compute-bound), then advances every
running answer of a model by one token in one batched step (`Runner.decode_step`:
the weights are read once for the whole batch, which is what a decode step costs),
and repeats. An answer joins and leaves the batch at any step; each samples with
its own generator, so it is the answer it would have been alone. All store
operations happen on the worker, so entries need no locks; an entry a running
answer is still writing is copied from, never extended by another request.

With `heal` (serve --heal) the worker spends idle time making handed-off rows exact: when no answer
runs and no request waits, it re-prefills the most recently used entry that holds rows a handoff left
(`transfer.conversation.heal`), `HEAL_STEP` positions at a time so that a request arriving meanwhile
waits for one step at most. The next turn of that conversation then reuses only the model's own rows
(its response says so: `reused_approximate_tokens` 0), and a handoff costs accuracy on the turn it
served, not on every turn after (docs/RESULTS.md 9).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, get_args

import torch

from ..engine.generate import Row, SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import Started, check_maps, heal, prefill_or_handoff
from ..transfer.gate import GatePolicy
from ..transfer.handoff import HandoffConfig, check_rho
from ..transfer.mapper import Mapper
from ..transfer.selectors import SELECTORS
from .store import Entry, PrefixStore

Role = Literal["system", "user", "assistant"]  # what a message's role may be (the HTTP front's schema too)
ROLES: tuple[str, ...] = get_args(Role)
MAX_STOP, MAX_STOP_CHARS = 4, 64  # OpenAI's limit on stop strings; a bound on what is held back
MAX_SALT = 1024  # characters of a cache salt
log = logging.getLogger(__name__)
HEAL_STEP = 256  # positions one idle healing step re-prefills (what a request arriving meanwhile waits for)


@dataclass(frozen=True)
class Budget:
    """How one request's prompt is handed off, if it is: a fixed budget, or the quality gate's policy."""

    handoff: HandoffConfig
    gate: GatePolicy | None = None

    def __post_init__(self):
        for sel in (self.handoff.scorer, None if self.gate is None else SELECTORS[self.gate.selector]):
            if sel is not None and sel.oracle:
                raise RarecacheError(f"selector {sel.name} is an oracle (it reads the target's own prefill): "
                                     "for evaluation, not for serving")

    @property
    def selector(self) -> str:
        return self.gate.selector if self.gate is not None else self.handoff.name


@dataclass(frozen=True)
class ServiceConfig:
    handoff: HandoffConfig = HandoffConfig(rho=0.3)
    gate: GatePolicy | None = None  # hand off through the quality gate (adaptive ρ, fallback) instead
    cache_bytes: int = 4 << 30  # budget for the held caches of all models together
    max_new_tokens: int = 1024  # the most one request may ask for
    max_prompt_chars: int = 200_000  # checked before tokenising
    max_batch: int = 8  # answers decoded together; past it, requests wait for a place
    request_budget: bool = True  # a request may name its own budget (False: only the server's own)
    heal: bool = False  # when idle, re-prefill the rows handoffs left, so later turns reuse exact rows

    def __post_init__(self):
        if self.max_batch < 1 or self.cache_bytes <= 0 or self.max_new_tokens < 1:
            raise ValueError("max_batch and max_new_tokens must be >= 1 and cache_bytes > 0")
        self.budget  # noqa: B018 - refuses an oracle selector

    @property
    def budget(self) -> Budget:
        """The server's own budget: what a request that names none is handed off with."""
        return Budget(self.handoff, self.gate)


def request_budget(cfg: ServiceConfig, rho: float | str | None = None, selector: str | None = None) -> Budget:
    """A request's own budget (the `rarecache` object of its body) against the server's: `rho` a share
    in [0, 1] or "auto" (the server's gate policy), `selector` one the server may run (no oracle);
    a `selector` alone keeps the server's ρ (on a gated server it needs a `rho`), a `rho` alone the
    server's selector (on a gated server the policy's). Every mistake is a RarecacheError, raised
    before the request is queued."""
    server = cfg.budget
    if rho is None and selector is None:
        return server
    if selector is not None and not isinstance(selector, str):
        raise RarecacheError(f"rarecache.selector must be a selector's name, got {selector!r}")
    if rho == "auto":
        if cfg.gate is None:
            raise RarecacheError("rarecache.rho auto needs a server started with --rho auto --gate-policy FILE")
        if selector is not None and selector != cfg.gate.selector:
            raise RarecacheError(f"rarecache.rho auto hands off with the gate policy's selector "
                                 f"({cfg.gate.selector}); leave selector out")
        return server
    if rho is None:
        if cfg.gate is not None:
            raise RarecacheError("this server picks the budget per request (--rho auto): a request naming a "
                                 "selector must name its rho too (a number, or \"auto\")")
        rho = cfg.handoff.rho
    rho = check_rho(rho, "rarecache.rho")
    if selector is not None:
        own = Budget(HandoffConfig.named(rho, selector, cfg.handoff.seed))
    elif cfg.gate is not None:
        own = Budget(HandoffConfig.named(rho, cfg.gate.selector, cfg.handoff.seed))
    else:
        own = Budget(replace(cfg.handoff, rho=rho))  # the server's selector or schedule, and seed
    if not cfg.request_budget and own != server:
        raise RarecacheError("this server hands off with its own budget only (rarecache serve "
                             "--no-request-budget): leave rarecache.rho and selector out")
    return own


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
    rho: float | None = None  # the budget a handoff had: ρ (the gate's rung, 1.0 on a fallback) and selector
    selector: str | None = None
    reused_approximate: int = 0  # of the reused positions, those an earlier handoff left not the model's own
    continued: int = 0  # continue_final: tokens of the final assistant message, the last of `prompt_tokens`
    # continue_final with logprobs: per token of that message, (token, logprob, rank in the vocabulary, its text)
    prompt_logprobs: list[tuple[int, float, int, str]] | None = None


@dataclass(frozen=True)
class Continued:
    """A request ending in an assistant message to continue, as `prepare_continued` tokenised it."""

    ids: list[int]  # the prompt before the final message, with the template's generation prompt
    tokens: list[int]  # the final message's text, tokenised on its own (as `Conversation.score` reads an answer)


@dataclass(eq=False)
class _Job:
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
    reply: "Reply | None" = None
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


def check_request(models, cfg, model: str, messages: list[dict[str, str]], sampling: SamplingConfig | None,
                  stop: tuple[str, ...] = (), salt: str | None = None, continue_final: bool = False) -> None:
    """Every mistake a client can make in a chat request, for any engine's service (`cfg` gives
    max_prompt_chars and max_new_tokens; `models` the names served). `continue_final`: the last
    message is the assistant's, to be continued (`sampling` None: read, with no answer)."""
    if model not in models:
        raise ModelNotFound(f"unknown model {model!r}; this server has {', '.join(models)}")
    if not messages:
        raise RarecacheError("messages is empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RarecacheError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content")
    if continue_final and messages[-1]["role"] != "assistant":
        raise RarecacheError("continue_final_message needs the last message to be the assistant's (the text to "
                             f"continue), not the {messages[-1]['role']}'s")
    if not continue_final and messages[-1]["role"] == "assistant":
        raise RarecacheError("the last message is the assistant's; there is nothing to answer "
                             "(continue_final_message continues or scores it)")
    if sum(len(m["content"]) for m in messages) > cfg.max_prompt_chars:
        raise RarecacheError(f"the messages exceed {cfg.max_prompt_chars} characters")
    if sampling is not None and sampling.max_new_tokens > cfg.max_new_tokens:
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
        self.healed = 0  # positions re-prefilled by idle healing (ServiceConfig.heal)

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

    def check_budget(self, rho: float | str | None = None, selector: str | None = None) -> Budget:
        """A request's own handoff budget, checked (`request_budget`); None, None: the server's."""
        return request_budget(self.cfg, rho, selector)

    def complete(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                 stop: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, salt: str | None = None, *,
                 rho: float | str | None = None, selector: str | None = None) -> Reply:
        """Answer the conversation `messages` with `model` (greedy unless sampling says otherwise).

        `stop`: strings that end the answer (left out of it). `on_text(piece)` is called with each
        new piece of the answer as it is decoded (streaming): never half a character, never the
        start of what may become a stop string. `cancelled()` returning True ends decoding early
        (a client that went away), which frees the service for the next request. `salt`: the
        answer reuses (and leaves) cached rows only among requests with the same salt. `rho`,
        `selector`: this request's handoff budget instead of the server's (`request_budget`).
        """
        return self.answer(model, self.prepare(model, messages, sampling, stop, salt), sampling, stop, on_text,
                           cancelled, salt, rho=rho, selector=selector)

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...] = (),
               on_text: Callable[[str], None] | None = None,
               cancelled: Callable[[], bool] | None = None, salt: str | None = None, *,
               rho: float | str | None = None, selector: str | None = None) -> Reply:
        """`complete` for a prompt `prepare` has already checked and tokenised: queue it and wait."""
        return self._submit(_Job(model, ids, sampling, tuple(stop), on_text, cancelled, salt,
                                 budget=self.check_budget(rho, selector)))

    def prepare_continued(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig | None,
                          stop: tuple[str, ...] = (), salt: str | None = None) -> Continued:
        """`prepare` for a request whose last message is the assistant's, to continue (`sampling` None:
        only to read it, with no answer). The messages before it are rendered with the template's
        generation prompt and the final message's text is tokenised on its own after them: the
        sequence `Conversation.score` reads for a given answer."""
        check_request(self.models, self.cfg, model, messages, sampling, stop, salt, continue_final=True)
        if len(messages) < 2:
            raise RarecacheError("continue_final_message needs a message before the final assistant one")
        llm = self.models[model]
        ids = llm.encode([{"role": m["role"], "content": m["content"]} for m in messages[:-1]])
        tokens = llm.tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        if not tokens:
            raise RarecacheError("the final assistant message is empty: there is nothing to continue or score")
        llm.check_fits(len(ids) + len(tokens), 0 if sampling is None else sampling.max_new_tokens, model)
        return Continued(ids, tokens)

    def continue_final(self, model: str, prompt: Continued, sampling: SamplingConfig | None,
                       stop: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None,
                       cancelled: Callable[[], bool] | None = None, salt: str | None = None,
                       logprobs: bool = True, *, rho: float | str | None = None,
                       selector: str | None = None) -> Reply:
        """Give `model` the rows of `prompt.ids` as `answer` does (kept, prefilled or handed off), then
        let it read the final message's tokens itself: with `logprobs`, the reply's `prompt_logprobs`
        scores each of them; their rows stay held for the next turn as `Conversation.score` leaves
        them (all but the last token's, when no answer is asked). With `sampling`, the answer then
        continues the message (`text`, `tokens` are the continuation only). `rho`, `selector`: as `complete`."""
        return self._submit(_Job(model, prompt.ids, sampling, tuple(stop), on_text, cancelled, salt,
                                 continued=list(prompt.tokens), logprobs=logprobs,
                                 budget=self.check_budget(rho, selector)))

    def _submit(self, job: _Job) -> Reply:
        """Queue a job and wait for its reply."""
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

    def forget(self, model: str, salt: str | None) -> int:
        """Drop `model`'s held caches of `salt` that no running answer is writing (a conversation
        its client ended; the benches' way to have the next request read it anew). Returns how many."""
        with self.lock:  # the worker's: between two of its admissions or steps
            gone = [e for e in self.store.entries[model] if e.salt == salt and not e.busy]
            for e in gone:
                self.store.drop(model, e)
        return len(gone)

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
                while not self._running and not (self._waiting or self._closed) and self._to_heal() is None:
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
                    if job is None and not self._running and not self._closed:  # idle: one healing step
                        self._heal_step()
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

    def _to_heal(self) -> tuple[str, Entry] | None:
        """The most recently used entry no answer is writing that holds rows a handoff left (with heal)."""
        # (also read in _work's wait, outside the lock, where forget() may drop an entry meanwhile: a stale
        # answer there only wakes the worker, and _heal_step looks again under the lock)
        if not self.cfg.heal:
            return None
        pending = [(e.used, name, e) for name, es in self.store.entries.items() for e in list(es)
                   if not e.busy and e.held.inexact_from is not None]
        return max(pending, key=lambda t: t[0])[1:] if pending else None

    def _heal_step(self) -> None:
        """Re-prefill up to HEAL_STEP of the chosen entry's inexact rows (the worker's, under the lock);
        an entry that cannot be healed is dropped rather than left, its rows untrusted."""
        found = self._to_heal()
        if found is None:
            return
        name, entry = found
        try:
            self.healed += heal(self.models[name].runner, entry.held, HEAL_STEP)
        except Exception:  # noqa: BLE001  (a bug of ours: forget the entry, keep serving)
            log.exception("healing an entry of %s failed; the entry is dropped", name)
            self.store.drop(name, entry)

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
                job.reply = Reply(model, "", [], "stop", len(ids) + len(job.continued or ()), 0, None, None, None,
                                  dict(job.seconds))
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
            job.started = prefill_or_handoff(self.models, self.maps, job.budget.handoff, self._room(job), model, ids,
                                             {k: e.held for k, e in job.held.items()}, job.source, job.budget.gate)
        except Exception as e:  # noqa: BLE001  (reported to the request; the worker goes on)
            self._fail(job, e)
            return
        finally:
            if job.source is not None and job.source in job.held:  # the source's part is done
                job.held[job.source].busy = False
            self.store.evict()
        job.seconds["prefill_or_handoff"] = job.started.seconds
        logits = job.started.logits
        if job.continued is not None:
            try:
                logits = self._read(job)
            except Exception as e:  # noqa: BLE001
                self._fail(job, e)
                return
            if job.sampling is None:
                self._finish_read(job)
                return
        job.t_decode = time.perf_counter()
        checking = job.stop or job.on_text is not None or job.cancelled is not None
        job.row = Row(self.models[model].with_eos(job.sampling), (lambda toks: self._check(job, toks)) if checking
                      else None)
        self._running.append(job)
        job.seconds["first_token"] = time.perf_counter() - job.submitted  # its logits are here: TTFT
        self._take(job, logits)

    @staticmethod
    def _room(job: _Job) -> SamplingConfig:
        """What `prefill_or_handoff` makes room for: the answer, and a final message to continue before it
        (as `Conversation.score` asks: that message's tokens as the new ones, when no answer follows)."""
        if job.continued is None:
            return job.sampling
        return SamplingConfig(max_new_tokens=len(job.continued) + (0 if job.sampling is None else
                                                                   job.sampling.max_new_tokens))

    @torch.inference_mode()
    def _read(self, job: _Job) -> torch.Tensor | None:
        """The model reads the final message's tokens after the prompt's rows, as `Conversation.score`
        does (each token's logprob from the logits before it; the rows of all but the last written);
        with an answer to come, the last token is fed too and its logits returned. `job.ids` then
        ends with the message."""
        t0 = time.perf_counter()
        llm, cont, cache = self.models[job.model], job.continued, job.started.cache
        n = len(job.ids)
        lps = llm.runner.read(cont, n, cache, job.started.logits[0], job.logprobs)  # the message's rows stay
        if lps is not None:  # (len, V): each token's logprob, and its rank (1 + how many tokens are likelier)
            values = lps[torch.arange(len(cont)), torch.tensor(cont)]
            ranks = (lps > values[:, None]).sum(-1) + 1
            job.scored = [(t, v, r, llm.tokenizer.decode([t], skip_special_tokens=False))
                          for t, v, r in zip(cont, values.tolist(), ranks.tolist())]
        logits = None
        if job.sampling is not None:  # the answer continues the message: feed its last token
            last = n + len(cont) - 1
            logits = llm.runner.forward(torch.tensor([[cont[-1]]]), torch.tensor([[last]]), cache).logits
        job.ids = job.ids + cont
        job.seconds["score" if job.logprobs else "read"] = time.perf_counter() - t0
        return logits

    def _finish_read(self, job: _Job) -> None:
        """A continued message read with no answer: hold its rows (all but the last token's)."""
        entry = job.held[job.model]
        entry.held.ids = job.ids[:-1]
        entry.busy = False
        entry.used = time.monotonic()
        self.store.evict(tuple(job.held.values()))
        job.reply = self._reply(job, "", [], "length")
        job.done.set()

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
        job.reply = self._reply(job, text, row.tokens, reason)
        job.done.set()

    @staticmethod
    def _reply(job: _Job, text: str, tokens: list[int], reason: str) -> Reply:
        result, gated = job.started.handoff, job.started.gate
        budget, handed = job.budget, job.source is not None
        return Reply(job.model, text, tokens, reason, len(job.ids), job.started.keep, job.source,
                     None if result is None else len(result.positions[0]),
                     None if result is None else result.handed_off[0][1] - result.handed_off[0][0],
                     dict(job.seconds), None if gated is None else gated.record(),
                     (gated.rho if gated is not None else budget.handoff.rho) if handed else None,
                     budget.selector if handed else None,
                     job.started.reused_approximate, 0 if job.continued is None else len(job.continued),
                     job.scored)


def _cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in text, if any."""
    hits = [text.find(x) for x in stop if x in text]
    return min(hits) if hits else None
