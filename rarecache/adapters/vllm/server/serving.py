"""The chat service of `rarecache serve --engine vllm`: the same API over two vLLM engines.

`serve/app.py` is the HTTP front whichever engine answers, through the `ChatBackend` contract
(serve/contract.py) this service implements. `ChatService` (serve/service.py) runs both models in
our own Runner and hands a conversation between them through its in-memory prefix store. This one runs each
model in its own vLLM engine, both loading RarecacheConnector: every engine files the rows
of the requests it answered itself in a shared row store, and an engine given a map for its
peer hands off a prompt the peer has read. vLLM does the batching, the paged cache and the
decoding; this service decides, per request, which of the two it is.

The decision is the one ChatService makes, at vLLM's granularity (whole blocks): a request
goes to its model as an ordinary vLLM request under the tenant's salt, so vLLM's prefix cache
reuses that model's own rows of the conversation, unless the peer's rows in the store cover
more whole blocks of the prompt than the model's own do; then it is sent with a salt of its
own (the request-only rule, docs/VLLM.md) and the connector hands it off. Handed-off rows are
never filed or reused, so a later turn on that model is handed off again from the peer's
rows, never from approximate ones. Rows are only ever found under the tenant's scope. A prompt
shorter than the server's `min_handoff_tokens` is never handed off (serve/settings.py `too_short`), and
a request naming a map (`mapper`, a router's `x-vsr-kv-mapper-id`) is handed off through that map only.

What happened to a request is said by the process that did it: the worker files a record of
its load (peer, positions recomputed, ρ, or the error) under a name the service chose, before
the rows go into the paged cache, so a request whose rows were handed off always has one,
even if it is aborted (a stop string, a client that left) and vLLM returns no output for it.
The service reads the record back and checks it before it goes into the response.

With the quality gate (`--rho auto`), a handed-off request is judged at its first token, on what vLLM
computed of the prompt, and a rejected one is answered again from the model's own prefill (vllm_gate.py).

Each engine runs in a thread of ours that adds requests, steps the engine and aborts what a
stop string or a departed client ended, all between steps. vLLM spawns its engine processes:
scripts that build this service need the `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ....engine.generate import SamplingConfig
from ....engine.llm import generation_eos
from ....errors import RarecacheError
from ....models.config import ModelConfig
from ....models.tokenizer import Tokenizer
from ....packages import sha256_file
from ....serve.job import Reply
from ....serve.outcome import IDENTITY_MISMATCH, SHORT_PROMPT
from ....serve.request import Continued, check_request
from ....serve.settings import Budget, too_short
from ....transfer.mapper import Mapper
from ..connector.core import check_map, check_peer_fits, claim
from ..rowstore.interface import CHUNK, Hit, Miss, model_identity, same_model
from ..rowstore.store_open import open_store
from .engines import Engine, EngineJob, start_engine
from .records import account, outcome, settle
from .serve_config import VllmServeConfig, request_budget, rung
from .vllm_gate import Judge, always_fallback_record

CAPTURE_WAIT = 2.0  # seconds a request waits at most for rows an answer it follows is still filing
NO_FINAL_MESSAGE = "not supported by this server's engine (vllm): continue_final_message"


@dataclass
class VllmReply(Reply):
    prefilled: int | None = None  # prompt positions vLLM computed itself
    note: str | None = None  # why a handoff the service asked for did not happen, or is unverified
    handoff: dict[str, Any] | None = None  # the outcome in the store's words (records.outcome, settle)


def tenant_scope(salt: str | None) -> str:
    """The store scope of a tenant's rows: its cache_salt, or one scope for all requests without one."""
    return "-" if salt is None else f"t:{salt}"


@dataclass(frozen=True)
class _Model:
    path: Path
    identity: dict[str, str]
    config: ModelConfig
    tokenizer: Tokenizer


class VllmChatService:
    """The `ChatBackend` contract (serve/contract.py) over one vLLM engine per model.

    `models`: served name -> checkpoint directory; `maps`: (peer, model) -> map file fitted
    peer -> model (the engine of `model` hands off from `peer`). Everything is checked before
    any engine starts (about a minute each on a small CPU). `engine_kwargs` go to every `vllm.LLM`."""

    engine = "vllm"
    streams_outcome = False  # the outcome is known once vLLM returns the first output: no stream header waits
    healing, healed = False, 0  # vLLM's prefix cache keeps only a model's own rows: nothing to heal

    def __init__(self, models: dict[str, Path], maps: dict[tuple[str, str], Path], cfg: VllmServeConfig,
                 engine_kwargs: dict[str, Any] | None = None):
        self.cfg = cfg
        self.models: dict[str, _Model] = {}
        for name, path in models.items():
            path = Path(path)
            config = ModelConfig.from_dir(path)
            self.models[name] = _Model(path, model_identity(path), config,
                                       Tokenizer.from_dir(path, extra_eos=generation_eos(path, config)))
        self.maps = dict(maps)
        self.map_ids = {pair: sha256_file(path) for pair, path in self.maps.items()}
        for (a, b), path in self.maps.items():
            if a not in self.models or b not in self.models or a == b:
                raise RarecacheError(f"map {a} -> {b} names a model the service does not have")
            mapper = Mapper.load(path)
            mapper.check_fit(cfg.accept_poor_map, f"the map {a} -> {b} ({path})")
            check_map(mapper, self.models[b].identity, self.models[b].config, where=f"the map {a} -> {b} ({path})")
            if not same_model(mapper.info.source, self.models[a].identity):
                raise RarecacheError(f"the map {a} -> {b} ({path}) was fitted from {mapper.info.source['name']}, "
                                     f"not from {a}")
            check_peer_fits(mapper, self.models[a].config, self.models[b].config)
        self.store = open_store(cfg.store, cfg.store_bytes, cfg.store_ttl)
        self._filing: dict[tuple[str, str], tuple[list[int], float]] = {}  # (model, scope) -> (tokens, deadline)
        self._lock = threading.Lock()
        self.engines: dict[str, Engine] = {}
        try:
            for name in self.models:
                into = {a: str(p) for (a, b), p in self.maps.items() if b == name}
                self.engines[name] = Engine(name, start_engine(self.models[name].path, cfg, into, engine_kwargs or {}))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines = {}

    @property
    def load(self) -> tuple[int, int]:
        """(answers running, requests waiting for their first token)."""
        jobs = [j for e in list(self.engines.values()) for j in list(e.jobs.values())]
        running = sum(j.first is not None for j in jobs)
        return running, len(jobs) - running

    def held_bytes(self) -> int:
        return self.store.nbytes()

    def store_stats(self) -> dict[str, Any]:
        """The row store's counters (store.RowStore.stats: hits, misses by reason, bytes, evictions, entries)."""
        return self.store.stats()

    # -- requests ----------------------------------------------------------------------------

    def prepare(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                stop: tuple[str, ...] = (), salt: str | None = None) -> list[int]:
        """Validate and tokenise a request, as ChatService.prepare (with vLLM's max_model_len)."""
        check_request(self.models, self.cfg, model, messages, sampling, stop, salt)
        ids = self.models[model].tokenizer.encode_chat([{"role": m["role"], "content": m["content"]}
                                                        for m in messages])
        if not ids:
            raise RarecacheError("the prompt is empty")
        limit = self.engines[model].max_model_len
        if len(ids) + sampling.max_new_tokens > limit:
            raise RarecacheError(f"prompt + max_tokens = {len(ids) + sampling.max_new_tokens} tokens (prompt "
                                 f"{len(ids)} + {sampling.max_new_tokens} new) exceeds {model}'s {limit} "
                                 "(vLLM's max_model_len)")
        return ids

    def check_budget(self, rho: float | str | None = None, selector: str | None = None) -> Budget:
        """A request's own budget instead of the service's, checked (serve_config.request_budget)."""
        return request_budget(self.cfg, rho, selector)

    def prepare_continued(self, model, messages, sampling, stop=(), salt=None) -> Continued:
        """Not in this engine: vLLM's prompt log-probabilities would score a prompt its prefix cache re-read."""
        raise RarecacheError(NO_FINAL_MESSAGE)

    def continue_final(self, *args, **kwargs) -> Reply:
        raise RarecacheError(NO_FINAL_MESSAGE)

    def peer_for(self, model: str, ids: list[int], salt: str | None, rho: float | None = None,
                 selector: str | None = None) -> str | None:
        """The peer to hand `ids` off from: one whose rows cover more whole blocks than `model`'s own."""
        return self.route(model, ids, salt, rho, selector)[0]

    def route(self, model: str, ids: list[int], salt: str | None, rho: float | str | None = None,
              selector: str | None = None, mapper: str | None = None) -> tuple[str | None, dict[str, Any]]:
        """(the peer to hand `ids` off from, or None; the outcome if there is none). `mapper`: through the
        map of that id only."""
        bs, scope, P = self.engines[model].block_size, tenant_scope(salt), len(ids)
        budget = self.check_budget(rho, selector)
        rho, selector = rung(budget), budget.selector
        self._settle(scope)
        into = [a for (a, b) in self.maps if b == model]
        peers = [a for a in into if mapper in (None, self.map_ids[(a, model)])]
        own = self.store.find(self.models[model].identity, scope, ids)
        mine = min(own.length, P - 1) // bs * bs if isinstance(own, Hit) else 0
        if not into:
            return None, outcome("unsupported", "no_map", detail=f"no map into {model}")
        if not peers:
            return None, outcome("fallback_reprefill", IDENTITY_MISMATCH, detail=f"no map {mapper[:64]} into {model}")
        best, most, miss = None, mine, None
        for a in peers:
            found = self.store.find(self.models[a].identity, scope, ids)
            if isinstance(found, Miss):
                miss = found if miss is None or found.reason != "no_entry" else miss
                continue
            n = claim(P, found.length, bs, rho, selector)[0]
            if n > most:
                best, most = a, n
            elif n == 0:
                miss = miss or Miss("no_entry", f"the peer rows cover {found.length} tokens: less than a block")
        if best is not None and too_short(self.cfg.min_handoff_tokens, P):
            return None, outcome("fallback_reprefill", SHORT_PROMPT,
                                 detail=f"{P} prompt tokens, fewer than {self.cfg.min_handoff_tokens}")
        if best is not None:
            return best, {}
        if mine > 0 and (miss is None or miss.reason == "no_entry"):
            return None, outcome("not_needed", "own_rows", detail=f"{model}'s own rows cover {mine} tokens")
        if isinstance(own, Miss) and own.reason == "store_down":
            miss = own
        miss = miss or Miss("no_entry", "no peer rows cover more of the prompt")
        return None, outcome("fallback_reprefill", miss.reason, detail=miss.detail)

    def _settle(self, scope: str) -> None:
        """Wait (at most CAPTURE_WAIT) for the rows of answers in `scope` still being filed: vLLM files a
        finished request's rows one engine step after its last token, and a next turn sent at once
        should find them, as it would in ChatService."""
        for m in self.models:
            with self._lock:
                filing = self._filing.get((m, scope))
            if filing is None:
                continue
            tokens, deadline = filing
            while time.monotonic() < deadline:
                hit = self.store.lookup(self.models[m].identity, scope, tokens)
                if hit is not None and hit.length >= len(tokens):
                    break
                time.sleep(0.005)
            with self._lock:
                if self._filing.get((m, scope)) is filing:
                    del self._filing[(m, scope)]

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...] = (),
               on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
               salt: str | None = None, *, reread: bool = False, rho: float | str | None = None,
               selector: str | None = None, mapper: str | None = None,
               on_start: Callable[[dict], None] | None = None) -> VllmReply:
        """Answer a prompt `prepare` checked: hand it off if the peer holds more of it, else let the
        model's vLLM engine prefill it (reusing its own cached blocks), and say which it was.

        `rho`, `selector`: this request's budget instead of the service's ("auto": the gate's, vllm_gate.py);
        `mapper`: through the map of that id only. `on_start` is never called (`streams_outcome` False).
        `reread`: vLLM reads the whole prompt itself: no handoff, a salt of its own (its prefix cache
        holds nothing of the prompt) and nothing filed; the benches' baseline (bench/serve.py, bench/load.py)."""
        arrived = time.perf_counter()  # first_token counts the routing below too
        asked = rho, selector
        budget = request_budget(self.cfg, rho, selector)
        rho, selector, gate = rung(budget), budget.selector, budget.gate
        peer, routed = (None, outcome("unsupported", "reread")) if reread else self.route(model, ids, salt, *asked,
                                                                                          mapper=mapper)
        gated = None  # the gate's record, once it decided
        if peer is not None and gate is not None and gate.always_falls_back:  # decided before any handoff
            peer, gated = None, always_fallback_record()
            routed = outcome("fallback_reprefill", "gate", detail=gated["reason"])
        judge = Judge(gate, ids) if peer is not None and gate is not None else None
        record = uuid.uuid4().hex
        if reread:
            vsalt, rc = f"r:{uuid.uuid4().hex}", {"handoff": False, "capture": False}
        elif peer is None:  # the tenant's salt: vLLM's prefix cache shares this model's rows within it
            vsalt, rc = (None if salt is None else f"t:{salt}"), {"handoff": False}
        else:  # a salt of its own: nothing else can reach its (approximate) blocks
            vsalt, rc = f"h:{uuid.uuid4().hex}", {"record": record, "rho": rho, "selector": selector}
        job = self._run(model, f"rc-{record}", ids, sampling, stop, on_text, cancelled, arrived, salt, vsalt, rc, judge)
        if job.rejected:  # the gate refused the handoff (nothing was shown): the model answers from its own prefill
            self._drop_record(record)
            peer, gated = None, judge.record()
            routed = outcome("fallback_reprefill", "gate", detail=gated["reason"][:300])
            if cancelled is not None and cancelled():  # the client left: no second answer, nothing of the first
                job.output, job.first = None, None
            else:
                job = self._run(model, f"rc-{uuid.uuid4().hex}", ids, sampling, stop, on_text, cancelled, arrived,
                                salt, None if salt is None else f"t:{salt}", {"handoff": False})
        reply = self._reply(model, ids, job, salt, peer, record if peer is not None else None)
        if reply.handoff is None:
            settle(reply, routed)
        if judge is not None and judge.ran and gated is None and reply.handoff_status == "applied":
            gated = judge.record()  # accepted (a handoff that failed, and vLLM read itself, was no gate's)
        if gated is not None:
            reply.gate = gated
            if gated["decision"] == "fallback":  # as our engine: rho 1.0, the policy's selector
                reply.rho, reply.selector = 1.0, gate.selector
        if reply.handoff_status == "applied":
            reply.mapper_id = self.map_ids[(reply.handed_off_from, model)]
        return reply

    def _run(self, model: str, rid: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...],
             on_text: Callable[[str], None] | None, cancelled: Callable[[], bool] | None, arrived: float,
             salt: str | None, vsalt: str | None, rc: dict[str, Any], judge: Judge | None = None) -> EngineJob:
        """One request to the model's engine, run to its end; `judge` (vllm_gate.py) asks for the prompt
        log-probabilities it reads."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        m = self.models[model]
        read = {} if judge is None else {"prompt_logprobs": 0, "skip_reading_prefix_cache": False}  # (vllm_gate.py)
        params = SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p, seed=sampling.seed, ignore_eos=sampling.ignore_eos, detokenize=False,
            stop_token_ids=[] if sampling.ignore_eos else list(m.tokenizer.eos_token_ids),  # (vLLM stops on them even
            output_kind=RequestOutputKind.CUMULATIVE,  # with ignore_eos)
            extra_args={"kv_transfer_params": {"rarecache": {"scope": tenant_scope(salt), **rc}}}, **read)
        prompt = {"prompt_token_ids": ids, **({"cache_salt": vsalt} if vsalt else {})}
        job = EngineJob(rid=rid, prompt=prompt, params=params, tokenizer=m.tokenizer, model=model, ids=ids,
                        sampling=sampling, stop=tuple(stop), on_text=on_text, cancelled=cancelled, salt=salt,
                        submitted=arrived, judge=judge)
        self.engines[model].submit([job])
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job

    def _drop_record(self, record: str) -> None:
        """Take a rejected handoff's record out of the store (what it did is not the answer's)."""
        try:
            self.store.take_record(record)
        except (RarecacheError, OSError):
            pass

    def _reply(self, model: str, ids: list[int], job: EngineJob, salt: str | None, peer: str | None,
               record: str | None) -> VllmReply:
        m, out = self.models[model], job.output
        comp = out.outputs[0] if out is not None and out.outputs else None
        tokens = list(comp.token_ids) if comp is not None else []
        reason = (comp.finish_reason if comp is not None else None) or "stop"
        if tokens and reason == "stop" and tokens[-1] in m.tokenizer.eos_token_ids:
            tokens = tokens[:-1]  # as our Row: an end token is not part of the answer
        text, stopped = job.last(m.tokenizer.decode(tokens))
        if job.error is not None:  # on_text failed: the client's side
            raise job.error
        if stopped or job.stopped or reason not in ("stop", "length"):
            reason = "stop"  # a stop string, or aborted: the client left
        seconds = {}
        if job.first is not None:
            seconds = {"first_token": job.first - job.submitted, "decode": job.ended - job.first}
        cached = (out.num_cached_tokens or 0) if out is not None else 0
        scheduler = ((out.kv_transfer_params or {}) if out is not None else {}).get("rarecache") or {}
        reply = VllmReply(model=model, text=text, tokens=tokens, finish_reason=reason, prompt_tokens=len(ids),
                          reused=cached, handed_off_from=None, recomputed=None, handed_off=None, seconds=seconds,
                          prefilled=len(ids) - cached)
        captured = scheduler.get("captured")
        if type(captured) is int and captured >= CHUNK and comp is not None:  # being filed now
            with self._lock:
                self._filing[(model, tenant_scope(salt))] = ((ids + list(comp.token_ids))[:captured],
                                                             time.monotonic() + CAPTURE_WAIT)
        if record is not None:
            self._account(reply, model, ids, peer, record, scheduler, seconds)
        return reply

    def _account(self, reply: VllmReply, model: str, ids: list[int], peer: str, record: str,
                 scheduler: dict[str, Any], seconds: dict[str, float]) -> None:
        """What the handoff the service asked for did, from the worker's record (checked)."""
        peers = {a: self.models[a].identity for (a, b) in self.maps if b == model}
        account(reply, self.store, record, self.models[model].identity, peers, len(ids),
                self.engines[model].block_size, peer, scheduler, seconds)

    def describe(self, reply: VllmReply) -> dict[str, Any]:
        """What the response's `rarecache` object adds to every engine's fields: what vLLM prefilled itself,
        and the outcome in the row store's words."""
        info: dict[str, Any] = {"prefilled_tokens": reply.prefilled}
        if reply.note is not None:
            info["note"] = reply.note
        if reply.handoff is not None:  # (the response's `handoff` and `fallback_reason`: serve/outcome.py)
            info["handoff_detail"] = {k: v for k, v in reply.handoff.items() if v is not None}
        return info

    # -- raw requests (tests, diagnostics) ------------------------------------------------

    def run_requests(self, model: str, prompts: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        """vLLM requests as they are (`prompt_token_ids`, `cache_salt`; SamplingParams), added to the
        model's engine together, so they can be scheduled in one step; their final RequestOutputs."""
        jobs = [EngineJob(rid=f"raw-{uuid.uuid4().hex}", prompt=p, params=sp) for p, sp in zip(prompts, params)]
        self.engines[model].submit(jobs)
        for job in jobs:
            job.done.wait()
            if job.error is not None:
                raise job.error
        return [job.output for job in jobs]

    def call(self, model: str, fn: Callable[[Any], Any]) -> Any:
        """fn(vllm.LLM) on the engine's thread, between steps."""
        return self.engines[model].call(fn)


__all__ = ["VllmChatService", "VllmServeConfig", "VllmReply", "tenant_scope"]
