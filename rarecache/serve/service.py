"""Chat completions for a family of models that share one cache store across models.

A serving API is stateless: every request carries the whole conversation. The
service keeps, per model, the caches of recent token sequences (a prefix cache)
and answers a request from the best of two starting points: the requested model's
own longest matching prefix, or a longer prefix held by another model of the pair
with a map into the requested one. In the second case the conversation is handed
off (map + selective recompute) instead of being re-read, which is the point of
rarecache: a router can move a conversation between models at every turn. The
entries, how a request claims one and how they are evicted are in `serve/prefix_store.py`.
A request's `salt` (the API's `cache_salt`) scopes both starting points: only entries
written under the same salt are reused or handed off, so tenants with different salts
never read, extend or time each other's rows.

A request may also end in an assistant message to be continued (`continue_final`, the API's
`continue_final_message`): the prompt before that message gets its rows as above, then the
model reads the message itself, scoring each of its tokens (the API's `prompt_logprobs`)
and keeping their rows exactly as `Conversation.score` does, so the next turn, on either
model, keeps or hands off from them; with no answer asked (`max_tokens` 0) that is all,
else the answer continues the message.

Requests are scheduled continuously by one worker thread (serve/worker.py: admission, then
batched decode steps); a request is checked and tokenised before it is queued (serve/request.py),
and its handoff budget is the server's or its own (serve/settings.py). This module is the service's
face: the calls a client (the HTTP front, the benches) makes, the `ChatBackend` contract the front
relies on (serve/contract.py), and idle healing.

With `heal` (serve --heal) the worker spends idle time making handed-off rows exact: when no answer
runs and no request waits, it re-prefills the most recently used entry that holds rows a handoff left
(`transfer.conversation.heal`), `HEAL_STEP` positions at a time so that a request arriving meanwhile
waits for one step at most. The next turn of that conversation then reuses only the model's own rows
(its response says so: `reused_approximate_tokens` 0), and a handoff costs accuracy on the turn it
served, not on every turn after (docs/RESULTS.md 9).
"""

from __future__ import annotations

import logging
from typing import Callable

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import check_maps, heal
from ..transfer.mapper import Mapper
from .job import Reply, Scheduled
from .prefix_store import Entry
from .request import MAX_SALT, MAX_STOP, MAX_STOP_CHARS, ROLES, Continued, ModelNotFound, Role, check_request
from .settings import Budget, ServiceConfig, request_budget
from .worker import Scheduler

__all__ = ["Budget", "ChatService", "Continued", "MAX_SALT", "MAX_STOP", "MAX_STOP_CHARS", "ModelNotFound", "ROLES",
           "Reply", "Role", "ServiceConfig", "check_request", "request_budget"]
log = logging.getLogger(__name__)
HEAL_STEP = 256  # positions one idle healing step re-prefills (what a request arriving meanwhile waits for)


class ChatService(Scheduler):
    """Our own engine behind the `ChatBackend` contract. `map_ids`: (source, target) -> the id a response
    gives its map by (the map file's sha256), where the caller knows it."""

    engine = "rarecache"
    streams_outcome = True  # `answer` and `continue_final` take on_start (serve/outcome.py)

    def __init__(self, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper],
                 cfg: ServiceConfig = ServiceConfig(), map_ids: dict[tuple[str, str], str] | None = None):
        check_maps(models, maps, "the service")
        super().__init__(models, maps, cfg, map_ids)
        self.healed = 0  # positions re-prefilled by idle healing (ServiceConfig.heal)

    @property
    def healing(self) -> bool:
        return self.cfg.heal

    def held_bytes(self) -> int:
        return self.store.nbytes()

    def store_stats(self) -> dict:
        return self.store.stats()

    def describe(self, reply: Reply) -> dict:
        """Nothing beyond the fields every engine's response has (serve/app.py `_info`)."""
        return {}

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
               rho: float | str | None = None, selector: str | None = None, mapper: str | None = None,
               on_start: Callable[[dict], None] | None = None) -> Reply:
        """`complete` for a prompt `prepare` has already checked and tokenised: queue it and wait.
        `mapper`: hand off through the map of this id only (serve/outcome.py, ROUTER_MAPPER).
        `on_start(fields)`: called once the prompt's rows are ready, before the first token, with the
        handoff's outcome (serve/outcome.py's `fields`), so a stream's headers can carry it."""
        return self._submit(Scheduled(model=model, ids=ids, sampling=sampling, stop=tuple(stop), on_text=on_text,
                                      cancelled=cancelled, salt=salt, budget=self.check_budget(rho, selector),
                                      mapper=mapper, on_start=on_start))

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
                       logprobs: bool = True, *, rho: float | str | None = None, selector: str | None = None,
                       mapper: str | None = None, on_start: Callable[[dict], None] | None = None) -> Reply:
        """Give `model` the rows of `prompt.ids` as `answer` does (kept, prefilled or handed off), then
        let it read the final message's tokens itself: with `logprobs`, the reply's `prompt_logprobs`
        scores each of them; their rows stay held for the next turn as `Conversation.score` leaves
        them (all but the last token's, when no answer is asked). With `sampling`, the answer then
        continues the message (`text`, `tokens` are the continuation only). `rho`, `selector`: as `complete`;
        `mapper`, `on_start`: as `answer`."""
        return self._submit(Scheduled(model=model, ids=prompt.ids, sampling=sampling, stop=tuple(stop),
                                      on_text=on_text, cancelled=cancelled, salt=salt, continued=list(prompt.tokens),
                                      logprobs=logprobs, budget=self.check_budget(rho, selector), mapper=mapper,
                                      on_start=on_start))

    def forget(self, model: str, salt: str | None) -> int:
        """Drop `model`'s held caches of `salt` that no running answer is writing (a conversation
        its client ended; the benches' way to have the next request read it anew). Returns how many."""
        with self.lock:  # the worker's: between two of its admissions or steps
            gone = [e for e in self.store.entries[model] if e.salt == salt and not e.busy]
            for e in gone:
                self.store.drop(model, e)
        return len(gone)

    # -- idle healing -------------------------------------------------------------------------

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
