"""The scheduler of `ChatService`: one worker thread, continuous batching, all store work on it.

The worker admits a waiting job (its prefill or handoff runs alone, being compute-bound), then
advances every running answer of a model by one token in one batched step (`Runner.decode_step`:
the weights are read once for the whole batch), and repeats. An answer joins and leaves the batch
at any step; each samples with its own generator, so it is the answer it would have been alone.
All store operations happen on the worker, so entries need no locks; an entry a running answer
is still writing is copied from, never extended by another request. When nothing runs or waits,
the worker calls the service's idle hook (`_to_heal`/`_heal_step`, serve/service.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..engine.generate import Row, SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import prefill_or_handoff
from ..transfer.mapper import Mapper
from .job import Reply, Scheduled
from .outcome import APPLIED, FALLBACK, IDENTITY_MISMATCH, SHORT_PROMPT, UNSUPPORTED, fields
from .prefix_store import Entry, PrefixStore
from .settings import ServiceConfig, too_short


class Scheduler:
    """Jobs in, replies out: the queue, the running batch and the worker thread over one `PrefixStore`."""

    def __init__(self, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper], cfg: ServiceConfig,
                 map_ids: dict[tuple[str, str], str] | None = None):
        self.models, self.maps, self.cfg = models, maps, cfg
        self.map_ids = {pair: (map_ids or {}).get(pair) for pair in maps}  # (source, target) -> the map's id or None
        self.store = PrefixStore(models, cfg.cache_bytes)  # touched by the worker only
        self.lock = threading.Lock()  # held by the worker while it works (one admission or one step)
        self._waiting: deque[Scheduled] = deque()
        self._running: list[Scheduled] = []
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def _submit(self, job: Scheduled) -> Reply:
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

    def close(self) -> None:
        """Stop the worker once the running answers end; waiting requests are refused."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._worker is not None:
            self._worker.join()

    def _to_heal(self) -> tuple[str, Entry] | None:  # the idle hook (serve/service.py)
        return None

    def _heal_step(self) -> None:
        pass

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
                    by_model: dict[str, list[Scheduled]] = {}
                    for j in self._running:
                        by_model.setdefault(j.model, []).append(j)
                    for model, jobs in by_model.items():
                        self._step(model, jobs)
                except Exception as e:  # noqa: BLE001  (a bug of ours: fail what runs, keep serving)
                    for j in [*self._running, *([job] if job is not None and not job.done.is_set() else [])]:
                        self._fail(j, e)

    def _fail(self, job: Scheduled, error: BaseException) -> None:
        for name, e in job.held.items():  # its rows cannot be trusted: drop its entries
            self.store.drop(name, e)
        if job in self._running:
            self._running.remove(job)
        job.error = error
        job.done.set()

    def _check(self, job: Scheduled, toks: list[int]) -> bool:
        """After each token: stream what is settled; True once a stop string appears or the client left."""
        return job.show(self.models[job.model].tokenizer.decode(toks)) or job.gone()

    def _claim(self, job: Scheduled) -> None:
        """Pick the job's starting points (its model's own longest prefix, or a longer one another model
        holds with a map into it: the map the request named, if it named one) and claim their entries. A
        prompt too short to hand off (`too_short`) keeps its own rows only."""
        model, ids, store = job.model, job.ids, self.store
        own, own_n = store.best(model, ids, job.salt)
        keep = min(own_n, len(ids) - 1)
        into = [a for (a, b) in self.maps if b == model and job.mapper in (None, self.map_ids[(a, b)])]
        src, src_n = None, 0
        for other in into:
            e, n = store.best(other, ids, job.salt)
            if e is not None and n > max(keep, src_n):
                job.source, src, src_n = other, e, n
        if job.source is not None and too_short(self.cfg.min_handoff_tokens, len(ids)):
            job.source, src, src_n, job.missed = None, None, 0, SHORT_PROMPT
        elif job.source is None and job.mapper is not None and not into:
            job.missed = IDENTITY_MISMATCH  # the map the router named is not one this server has into the model
        elif job.source is None:  # why not: had another model's longer prefix been evicted?
            lost = any(store.evicted_longer(a, ids, job.salt, keep) for a in into)
            job.missed = "evicted" if lost else "no_entry"
        job.held[model] = store.claim(model, self.models[model].runner, own, own_n, job.salt)
        if job.source is not None:
            job.held[job.source] = store.claim(job.source, self.models[job.source].runner, src, src_n, job.salt)
        now = time.monotonic()
        for e in job.held.values():
            e.used = now

    def _admit(self, job: Scheduled) -> None:
        """Claim the job's entries, prefill or hand off its prompt, take its first token."""
        job.seconds["queued"] = time.perf_counter() - job.submitted
        model, ids = job.model, job.ids
        try:
            if job.gone():  # the client left while it waited: nothing was handed off (nor looked for)
                job.missed = "no_entry"
                job.reply = Reply(model, "", [], "stop", len(ids) + len(job.continued or ()), 0, None, None, None,
                                  dict(job.seconds), **dict(zip(("handoff_status", "fallback_reason"),
                                                                self._status(job))))
                job.done.set()
                return
            self._claim(job)
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
        if job.on_start is not None:  # (a stream's headers wait for it)
            try:
                job.on_start(fields(*self._status(job), job.started.reused_approximate, self._mapper_id(job)))
            except Exception as e:  # noqa: BLE001  (the client's side)
                self._fail(job, e)
                return
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
    def _room(job: Scheduled) -> SamplingConfig:
        """What `prefill_or_handoff` makes room for: the answer, and a final message to continue before it
        (as `Conversation.score` asks: that message's tokens as the new ones, when no answer follows)."""
        if job.continued is None:
            return job.sampling
        return SamplingConfig(max_new_tokens=len(job.continued) + (0 if job.sampling is None else
                                                                   job.sampling.max_new_tokens))

    @torch.inference_mode()
    def _read(self, job: Scheduled) -> torch.Tensor | None:
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

    def _finish_read(self, job: Scheduled) -> None:
        """A continued message read with no answer: hold its rows (all but the last token's)."""
        entry = job.held[job.model]
        entry.held.ids = job.ids[:-1]
        entry.busy = False
        entry.used = time.monotonic()
        self.store.evict(tuple(job.held.values()))
        job.reply = self._reply(job, "", [], "length")
        job.done.set()

    def _take(self, job: Scheduled, logits: torch.Tensor) -> None:
        try:
            going = job.row.take(logits)
        except Exception as e:  # noqa: BLE001  (a failing on_text: the client's side)
            self._fail(job, e)
            return
        if not going:
            self._finish(job)

    def _step(self, model: str, jobs: list[Scheduled]) -> None:
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

    def _finish(self, job: Scheduled) -> None:
        model, row = job.model, job.row
        entry = job.held[model]
        entry.held.ids = job.ids + row.fed
        entry.busy = False
        entry.used = time.monotonic()
        self._running.remove(job)
        self.store.evict(tuple(job.held.values()))
        job.seconds["decode"] = time.perf_counter() - job.t_decode
        text, stopped = job.last(self.models[model].tokenizer.decode(row.tokens))  # (a failing on_text: job.error)
        reason = "stop" if stopped else row.finish_reason
        job.reply = self._reply(job, text, row.tokens, reason)
        job.done.set()

    def _status(self, job: Scheduled) -> tuple[str, str | None]:
        """What became of the job's handoff (serve/outcome.py), once its prompt's rows are ready."""
        if job.source is not None:
            gated = job.started.gate
            return (FALLBACK, "gate") if gated is not None and gated.decision == "fallback" else (APPLIED, None)
        if any(b == job.model for (_, b) in self.maps):
            return FALLBACK, job.missed
        return UNSUPPORTED, None

    def _mapper_id(self, job: Scheduled) -> str | None:
        """The id of the map that handed the job's prompt off (None if none did, or its id is unknown)."""
        applied = job.source is not None and self._status(job)[0] == APPLIED
        return self.map_ids[(job.source, job.model)] if applied else None

    def _reply(self, job: Scheduled, text: str, tokens: list[int], reason: str) -> Reply:
        result, gated = job.started.handoff, job.started.gate
        budget, handed = job.budget, job.source is not None
        return Reply(job.model, text, tokens, reason, len(job.ids), job.started.keep, job.source,
                     None if result is None else result.recomputed(0),
                     None if result is None else result.handed_off[0][1] - result.handed_off[0][0],
                     dict(job.seconds), None if gated is None else gated.record(),
                     (gated.rho if gated is not None else budget.handoff.rho) if handed else None,
                     budget.selector if handed else None,
                     job.started.reused_approximate, 0 if job.continued is None else len(job.continued),
                     job.scored, *self._status(job), self._mapper_id(job))
