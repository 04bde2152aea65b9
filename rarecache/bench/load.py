"""Throughput under concurrent load: continuous batching vs one request at a time.

A load generator for the chat service: `clients` threads each send `requests`
chat requests back to back (a held-out corpus passage and a question, a fixed
number of new tokens), against the same `ChatService` code twice in the same run,
once with `max_batch = 1` (every answer decoded alone, the server before batching)
and once with `max_batch = clients`. Decoding reads every weight once per step
whatever the batch, so the batched service should deliver several times the
tokens per second; latency per request is printed too, and the answers of the two
arms are compared (greedy, so they must agree apart from rare near-ties).

Inside vLLM (`--engine vllm`, `run_vllm_load_bench`) it is the serving experiment of the RaReCache
paper (§4.6, App. B.3): switched conversations arriving at the target as a homogeneous Poisson
process, served FCFS by vLLM's scheduler, TTFT p50/p99 and throughput against offered load
normalised to the target's own measured saturation rate, for vLLM alone (it re-reads every
prompt) and vLLM with the connector's handoff, under the same arrival traces on the same engines.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from ..defaults import SERVED
from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..serve.service import ChatService, Reply, ServiceConfig
from ..transfer.handoff import check_rho
from .serve import QUESTIONS, SwitchBenchConfig, ask_target, passages, switched_conversations


@dataclass(frozen=True)
class LoadBenchConfig:
    clients: int = 4
    requests: int = 2  # per client, back to back
    prompt_tokens: int = 128  # passage length in each request
    max_new_tokens: int = 32
    corpus: str = "wiki"

    def __post_init__(self):
        if not 1 <= self.clients <= 64 or self.requests < 1 or self.prompt_tokens < 16 or self.max_new_tokens < 1:
            raise RarecacheError("need 1 <= clients <= 64, requests >= 1, prompt tokens >= 16 and "
                                 "max new tokens >= 1")


def _arm(llm: LLM, name: str, prompts: list[list[list[dict]]], sampling: SamplingConfig,
         max_batch: int) -> tuple[float, list[list[Reply]]]:
    """Every client's requests through a fresh service; wall seconds and the replies per client."""
    svc = ChatService({name: llm}, {}, ServiceConfig(max_batch=max_batch, cache_bytes=1))  # nothing reused
    replies: list[list[Reply]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def client(c: int) -> None:
        try:
            for messages in prompts[c]:
                replies[c].append(svc.complete(name, messages, sampling))
        except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    svc.close()
    if errors:
        raise errors[0]
    return wall, replies


def run_load_bench(llm: LLM, cfg: LoadBenchConfig, cache_dir=None, emit=print) -> dict:
    name = llm.path.name
    n = cfg.clients * cfg.requests
    texts = passages(SwitchBenchConfig(conversations=n, passage_tokens=cfg.prompt_tokens, corpus=cfg.corpus),
                     llm, [], cache_dir)
    prompts = [[[{"role": "user", "content": f"{texts[c * cfg.requests + r]}\n\n{QUESTIONS[r % len(QUESTIONS)]}"}]
                for r in range(cfg.requests)] for c in range(cfg.clients)]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)  # every answer the same length
    ChatService({name: llm}, {}).complete(name, prompts[0][0], SamplingConfig(max_new_tokens=4))  # warm-up

    emit(f"{name}: {cfg.clients} clients x {cfg.requests} requests, prompts of ~{cfg.prompt_tokens} passage "
         f"tokens, {cfg.max_new_tokens} new tokens each; both arms in the same run, through the same service code")
    arms = {"one at a time": 1, "batched": cfg.clients}
    out: dict[str, dict] = {}
    replies: dict[str, list[list[Reply]]] = {}
    emit(f"{'arm':<14} {'max_batch':>9} {'wall s':>8} {'tokens/s':>9} {'latency s (median, max)':>24} "
         f"{'first token s (median, max)':>28}")
    for label, max_batch in arms.items():
        wall, got = _arm(llm, name, prompts, sampling, max_batch)
        flat = [r for rs in got for r in rs]
        latency = [sum(r.seconds.values()) for r in flat]
        first = [r.seconds["queued"] + r.seconds["prefill_or_handoff"] for r in flat]
        tokens = sum(len(r.tokens) for r in flat)
        out[label] = {"max_batch": max_batch, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                      "latency_median_s": statistics.median(latency), "latency_max_s": max(latency),
                      "first_token_median_s": statistics.median(first), "first_token_max_s": max(first)}
        replies[label] = got
        o = out[label]
        emit(f"{label:<14} {max_batch:>9} {wall:>8.1f} {o['tokens_per_s']:>9.1f} "
             f"{o['latency_median_s']:>12.1f} {o['latency_max_s']:>11.1f} "
             f"{o['first_token_median_s']:>14.1f} {o['first_token_max_s']:>13.1f}")
    a, b = ([r.tokens for rs in replies[k] for r in rs] for k in arms)
    same = sum(x == y for x, y in zip(a, b))
    speedup = out["batched"]["tokens_per_s"] / out["one at a time"]["tokens_per_s"]
    emit(f"throughput {speedup:.2f}x with batching; the same answer in both arms for {same} of {n} requests")
    return {"bench": "serve-load", "model": name, "clients": cfg.clients, "requests_per_client": cfg.requests,
            "prompt_tokens": cfg.prompt_tokens, "max_new_tokens": cfg.max_new_tokens, "arms": out,
            "throughput_speedup": speedup, "same_answers": same, "requests": n}


# ---------------------------------------------------------------------------------------
# the serving experiment of the RaReCache paper (§4.6, App. B.3): Poisson arrivals, FCFS
# ---------------------------------------------------------------------------------------
# The driver below knows nothing of the engine: an arm is `send(i) -> seconds to the first token of
# request i, measured from the call`. Saturation and offered load follow one rule (here only):
# μ = requests / wall seconds with `batches` full batches queued at once (the paper's eq. 10),
# and offered load u = λ / μ of the target alone.


@dataclass(frozen=True)
class PoissonConfig:
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 0.98)  # offered load λ / μ_target (the paper stops at 0.98)
    requests: int = 40  # per load and arm, the same arrival trace for both arms
    discard: int = 5  # the first arrivals are not counted (the queue filling up)
    prompt_tokens: int = 256  # the switched turn's prompt T
    answer_tokens: int = 16  # the source's answer to the first turn
    max_new_tokens: int = 1  # the target's answer: TTFT is the figure
    rho: float = SERVED.rho
    saturation_batches: int = 3
    seed: int = 0
    corpus: str = "wiki"

    def __post_init__(self):
        if not self.loads or len(set(self.loads)) != len(self.loads) or not all(
                isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 4 for u in self.loads):
            raise RarecacheError(f"--loads takes distinct offered loads in (0, 4], not {list(self.loads)}")
        if self.requests < 2 or not 0 <= self.discard < self.requests:
            raise RarecacheError("need --requests >= 2 and 0 <= --discard < --requests")
        check_rho(self.rho, "--rho")
        if self.saturation_batches < 1 or self.answer_tokens < 1 or self.max_new_tokens < 1:
            raise RarecacheError("need --saturation-batches, --answer-tokens and --max-new-tokens >= 1")


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    f = int(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


def _threads(send: Callable[[int], float], starts: list[float]) -> tuple[float, list[tuple[float, float]]]:
    """Request i sent at t0 + starts[i] on its own thread; t0 and (TTFT from the scheduled time, end) per request."""
    out: list[tuple[float, float] | None] = [None] * len(starts)
    errors: list[BaseException] = []

    def one(i: int, due: float) -> None:
        try:
            lag = time.perf_counter() - due
            ttft = send(i)
            out[i] = (lag + ttft, time.perf_counter())
        except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
            errors.append(e)

    threads = []
    t0 = time.perf_counter()
    for i, s in enumerate(starts):
        delay = t0 + s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        threads.append(threading.Thread(target=one, args=(i, t0 + s)))
        threads[-1].start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return t0, out  # type: ignore[return-value]


def saturation_rate(send: Callable[[int], float], n: int) -> float:
    """μ: n requests queued at once (a permanently full queue), n / the wall seconds until the last ends."""
    t0, done = _threads(send, [0.0] * n)
    return n / (max(end for _, end in done) - t0)


def poisson_trace(n: int, seed: int) -> list[float]:
    """Arrival times of a homogeneous Poisson process of rate 1; divide by λ for rate λ."""
    g = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += g.expovariate(1.0)
        out.append(t)
    return out


def open_loop(send: Callable[[int], float], arrivals: list[float], discard: int) -> dict:
    """Every request at its arrival time whatever the engine is doing; TTFT p50/p99 and throughput of
    those after the first `discard`."""
    t0, done = _threads(send, arrivals)
    kept = done[discard:]
    ttft = [x for x, _ in kept]
    span = max(end for _, end in kept) - (t0 + arrivals[discard])
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft), "throughput_rps": len(kept) / span, "counted": len(kept)}


class ServiceArms:
    """Our ChatService behind the interface the switched-turn benches drive (VllmChatService's
    `prepare` / `answer(..., reread=, rho=)`), so the paper's serving experiment runs on both
    engines with one driver. `reread`: a salt nobody used, so the target holds nothing of the
    prompt and reads all of it; a handoff is our service's own (its source entry under the
    conversation's salt). After each answer of the target the caches it kept of that salt are
    dropped, so the next request of the same conversation is handed off (or read) again, as in
    vLLM, where handed-off blocks are never reused."""

    def __init__(self, svc: ChatService):
        self.svc, self.models, self.cfg = svc, svc.models, svc.cfg

    def prepare(self, model: str, messages: list[dict], sampling: SamplingConfig, stop=(), salt=None) -> list[int]:
        return self.svc.prepare(model, messages, sampling, stop, salt)

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop=(), salt=None, *,
               reread: bool = False, rho: float | None = None) -> Reply:
        if reread:
            salt = f"reread-{uuid.uuid4().hex}"
        reply = self.svc.answer(model, ids, sampling, stop, salt=salt, rho=rho)
        if reread or rho is not None:  # the target's turn: read anew next time
            self.svc.forget(model, salt)
        reply.prefilled = len(ids) - reply.reused - (reply.handed_off or 0) + (reply.recomputed or 0)
        reply.note = None if rho is None or reply.handed_off_from is not None else "not handed off"
        return reply


def run_vllm_load_bench(svc, source: str, target: str, cfg: PoissonConfig, maps=(), settings=None, cache_dir=None,
                        emit=print) -> dict:
    """vLLM alone vs vLLM + handoff under the same Poisson traces (`run_poisson_bench` on vLLM)."""
    return run_poisson_bench(svc, source, target, cfg, maps, settings, cache_dir, emit, engine="vllm")


def run_poisson_bench(svc, source: str, target: str, cfg: PoissonConfig, maps=(), settings=None, cache_dir=None,
                      emit=print, engine: str = "vllm") -> dict:
    """The target alone vs the target with handoffs under the same Poisson traces, on the same
    service (VllmChatService, or our ChatService through `ServiceArms`; `engine` names the arms).
    Every request is a switched conversation's turn 2 whose turn 1 the source answered
    beforehand (untimed): the target's side is what is measured."""
    n_sat = cfg.saturation_batches * svc.cfg.max_batch
    convs = switched_conversations(svc, source, target, cfg.prompt_tokens, max(cfg.requests, n_sat),
                                   cfg.answer_tokens, cfg.max_new_tokens, list(maps), cfg.corpus, cache_dir)
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    alone, with_handoff = arm_names(engine)
    arms = {alone: None, with_handoff: cfg.rho}
    handed, lock = {arm: 0 for arm in arms}, threading.Lock()

    def sender(arm: str) -> Callable[[int], float]:
        def send(i: int) -> float:
            reply = ask_target(svc, source, target, *convs[i], sampling, arms[arm])
            if arms[arm] is not None and reply.handed_off_from == source and not reply.note:
                with lock:
                    handed[arm] += 1
            return reply.seconds["first_token"]
        return send

    for arm in arms:  # warm-up: a few requests together, not counted
        _threads(sender(arm), [0.0] * min(n_sat, 2))
    mu = {}
    for arm in arms:
        mu[arm] = saturation_rate(sender(arm), n_sat)
    if not handed[with_handoff]:
        raise RarecacheError("no request was handed off: the comparison would be vLLM against itself")
    where = "inside vLLM" if engine == "vllm" else f"on {engine}'s own server"
    emit(f"Poisson arrivals at {target} {where} (from {source}), prompts of ~{cfg.prompt_tokens} tokens, "
         f"{cfg.max_new_tokens} new, rho {cfg.rho:g}, max batch {svc.cfg.max_batch}, FCFS; saturation "
         f"({cfg.saturation_batches} full batches queued at once): {alone} {mu[alone]:.3f} req/s, with handoff "
         f"{mu[with_handoff]:.3f} req/s ({mu[with_handoff] / mu[alone]:.2f}x)")
    emit(f"{'load':>5} {'req/s':>7} {'arm':<18} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'done/s':>7} "
         f"{'handed off':>10}")
    trace = poisson_trace(cfg.requests, cfg.seed)
    points = []
    for j, u in enumerate(cfg.loads):
        rate = u * mu[alone]
        point = {"load": u, "rate_rps": rate}
        for arm in (list(arms) if j % 2 == 0 else list(arms)[::-1]):  # neither arm always first
            before = handed[with_handoff]
            point[arm] = open_loop(sender(arm), [t / rate for t in trace], cfg.discard)
            point[arm]["handed_off"] = handed[with_handoff] - before if arms[arm] is not None else 0
        points.append(point)
        for arm in arms:
            o = point[arm]
            emit(f"{u:>5g} {rate:>7.3f} {arm:<18} {o['ttft_p50_s'] * 1e3:>9.0f} {o['ttft_p99_s'] * 1e3:>9.0f} "
                 f"{o['ttft_mean_s'] * 1e3:>9.0f} {o['throughput_rps']:>7.3f} {o['handed_off']:>7}/{cfg.requests}")
    result = {"bench": f"{engine}-load", "engine": engine, "source": source, "target": target,
              "settings": {**(settings or {}), "loads": list(cfg.loads), "requests": cfg.requests,
                           "discard": cfg.discard, "prompt_tokens": cfg.prompt_tokens,
                           "answer_tokens": cfg.answer_tokens, "max_new_tokens": cfg.max_new_tokens, "rho": cfg.rho,
                           "saturation_batches": cfg.saturation_batches, "saturation_requests": n_sat,
                           "max_batch": svc.cfg.max_batch, "seed": cfg.seed, "corpus": cfg.corpus},
              "saturation_rps": mu, "points": points}
    s = load_summary(result)
    at = result["ttft_ratios_at_load"] = saturation_point(result)
    emit(f"throughput at saturation {s['saturation_throughput_ratio']:.2f}x with handoff; " + (
        f"at load {at}: p50 TTFT {s['saturation_p50_ttft_ratio']:.2f}x, p99 {s['saturation_p99_ttft_ratio']:.2f}x "
        "sooner" if at is not None else "no load <= 1 in the sweep for the TTFT ratios"))
    return result


def saturation_point(result: dict) -> float | None:
    """The offered load the TTFT ratios are read at: the highest <= 1 (the target's saturation rate;
    the paper's 0.98, where vLLM alone's queue has not yet diverged)."""
    under = [p["load"] for p in result["points"] if p["load"] <= 1]
    return max(under) if under else None


def arm_names(engine: str) -> tuple[str, str]:
    """The two arms of the Poisson bench on `engine`: the target alone, and with handoffs."""
    return engine, f"{engine}+handoff"


def load_summary(result: dict) -> dict:
    """The summary's keys for the load bench: μ with handoff / μ alone, and the target alone's TTFT
    over the handoff's at the saturation point."""
    mu, u = result["saturation_rps"], saturation_point(result)
    at = next((p for p in result["points"] if p["load"] == u), None)
    alone, with_handoff = arm_names(result.get("engine", "vllm"))

    def ratio(key: str) -> float | None:
        return at[alone][key] / at[with_handoff][key] if at else None

    return {"saturation_throughput_ratio": mu[with_handoff] / mu[alone],
            "saturation_p50_ttft_ratio": ratio("ttft_p50_s"), "saturation_p99_ttft_ratio": ratio("ttft_p99_s")}
