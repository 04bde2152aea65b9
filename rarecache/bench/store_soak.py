"""`rarecache bench store-soak`: the row store under steady switching traffic, capped small.

A deployment leaves the engines running for days, so the row store must stay under its cap
while every conversation keeps being answered. This drives the vLLM service (passed in from
commands/, as the other benches) with multi-turn conversations that switch model every turn,
round robin over `conversations` tenants, for `duration_s` seconds; a conversation that grows
past `max_prompt_tokens` starts again under a new tenant, so old rows go cold and must be
evicted. After every answer it reads the store's counters (`svc.store_stats()`: bytes,
evictions) and samples the resident memory of this process and its children (the engines).

Its checks are counts: store bytes never above the cap, no failed request (a missing or
evicted entry is a fallback, never an error), evictions > 0 (the cap was reached), RSS growth
from the end of the warm-up (the first tenth) under 5%. The JSON holds `store_cap_bytes`,
`store_bytes_max`, `failed`, `evictions`, `rss_growth` (a fraction) and the outcome counts.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass

from ..engine.generate import SamplingConfig
from ..errors import RarecacheError

WORDS = ("the store keeps rows of every answer until the cap is reached and the least recently used go first "
         "while conversations switch between the small and the large model on every turn").split()


@dataclass(frozen=True)
class StoreSoakConfig:
    duration_s: float = 1800.0
    conversations: int = 8  # tenants in flight, round robin
    turn_words: int = 48  # words in each user turn
    max_new_tokens: int = 16
    max_prompt_tokens: int = 1024  # a conversation longer than this starts again under a new tenant
    max_rss_growth: float = 0.05

    def __post_init__(self):
        if not self.duration_s > 0 or self.conversations < 1 or self.turn_words < 1 or self.max_new_tokens < 1:
            raise RarecacheError("store-soak needs --duration > 0 and --conversations, turn words, max tokens >= 1")


def _rss() -> int:
    try:
        import psutil
    except ImportError:
        raise RarecacheError("bench store-soak reads memory with psutil: pip install psutil") from None
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_store_soak(svc, models: tuple[str, str], cfg: StoreSoakConfig, emit=print, clock=time.monotonic) -> dict:
    """Drive `svc` (VllmChatService's prepare/answer/store_stats) with switching conversations for
    cfg.duration_s; returns the soak's record (see the module docstring)."""
    stats = svc.store_stats()
    cap = stats.get("cap_bytes")
    if not cap:
        raise RarecacheError("store-soak needs a bounded store: --store-gib for a directory, or a Redis server "
                             "with maxmemory")
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    evictions0, convs = stats.get("evictions") or 0, {}
    outcomes: Counter = Counter()
    requests = answered = failed = restarted = over = 0
    bytes_max, rss, errors = 0, [], []
    t0 = clock()
    end = t0 + cfg.duration_s
    while clock() < end:
        i = requests % cfg.conversations
        tenant, turn, msgs = convs.get(i) or (f"soak-{i}-0", 0, [])
        model = models[turn % 2]  # every turn switches model
        requests += 1
        words = [WORDS[(requests * 7 + j) % len(WORDS)] for j in range(cfg.turn_words)]
        msgs = msgs + [{"role": "user", "content": f"turn {turn}: " + " ".join(words)}]
        try:
            ids = svc.prepare(model, msgs, sampling, salt=tenant)
            if len(ids) > cfg.max_prompt_tokens:  # start the conversation again, under a new tenant
                restarted += 1
                convs[i] = (f"soak-{i}-{restarted}", 0, [])
                continue
            reply = svc.answer(model, ids, sampling, salt=tenant)
            answered += 1
            outcomes[(reply.handoff or {}).get("status", "none")] += 1
            msgs = msgs + [{"role": "assistant", "content": reply.text}]
            convs[i] = (tenant, turn + 1, msgs)
        except Exception as e:  # noqa: BLE001 - counted: the soak's first check
            failed += 1
            errors.append(f"{type(e).__name__}: {e}"[:300])
            convs.pop(i, None)
        now = svc.store_stats()
        bytes_max = max(bytes_max, now.get("bytes") or 0)
        over += (now.get("bytes") or 0) > cap
        rss.append((clock() - t0, _rss()))
    done = svc.store_stats()
    warm = [m for t, m in rss if t >= cfg.duration_s / 10] or [m for _, m in rss]
    growth = (warm[-1] - warm[0]) / warm[0] if warm and warm[0] else 0.0
    result = {"bench": "store-soak", "config": asdict(cfg), "store": done.get("backend"), "store_cap_bytes": cap,
              "store_bytes_max": bytes_max, "samples_over_cap": over, "requests": answered, "failed": failed,
              "errors": errors[:10], "evictions": (done.get("evictions") or 0) - evictions0,
              "conversations_restarted": restarted, "outcomes": dict(outcomes), "rss_start": warm[0] if warm else None,
              "rss_end": warm[-1] if warm else None, "rss_growth": growth,
              "misses_by_reason": done.get("misses_by_reason"), "hits": done.get("hits")}
    result["ok"] = (bytes_max <= cap and failed == 0 and result["evictions"] > 0
                    and growth < cfg.max_rss_growth)
    emit(f"store-soak: {answered} requests in {cfg.duration_s:g} s, failed {failed}, store max {bytes_max} of "
         f"{cap} bytes, {result['evictions']} evictions, RSS growth {growth:+.1%}, outcomes {dict(outcomes)}: "
         f"{'ok' if result['ok'] else 'FAILED'}")
    return result
