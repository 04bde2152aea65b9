"""Throughput under concurrent load: continuous batching vs one request at a time.

A load generator for the chat service: `clients` threads each send `requests`
chat requests back to back (a held-out corpus passage and a question, a fixed
number of new tokens), against the same `ChatService` code twice in the same run,
once with `max_batch = 1` (every answer decoded alone, the server before batching)
and once with `max_batch = clients`. Decoding reads every weight once per step
whatever the batch, so the batched service should deliver several times the
tokens per second; latency per request is printed too, and the answers of the two
arms are compared (greedy, so they must agree apart from rare near-ties).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..serve.service import ChatService, Reply, ServiceConfig
from .serve import QUESTIONS, SwitchBenchConfig, passages


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
