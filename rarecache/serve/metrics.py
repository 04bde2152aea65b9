"""`GET /metrics`: what an operator watches, in Prometheus text, per served model.

Per model: requests by handoff status, handoffs applied, fallbacks to the model's own prefill by
reason (serve/outcome.py), positions recomputed by handoffs, reuses of approximate rows, and a
time-to-first-token histogram; and the row store's hits, misses, evictions, bytes and entries.
Request figures are counted by the HTTP front from each response's `rarecache` fields, so they mean
the same whichever engine answered. Store figures are read at scrape time through the engine's
contract (serve/contract.py, `store_stats`: hits, misses, bytes, evictions and entries, per model
under "models" when it keeps them, else labelled model="all"); a store that cannot be read shows
`rarecache_store_up 0` instead of failing the scrape.

Each app has its own `CollectorRegistry` (not the library's global one), so several apps in one
process (tests, two servers) never collide.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .contract import ChatBackend
from .outcome import REASONS, STATUSES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)  # seconds
STORE_COUNTS = ("hits", "misses", "evictions")  # since the store started
STORE_GAUGES = ("bytes", "entries")  # now
log = logging.getLogger(__name__)


class _StoreCollector:
    """The service's row store, read at each scrape."""

    def __init__(self, service: ChatBackend):
        self.service = service

    def describe(self):
        return []  # (collected at scrape time only)

    def collect(self):
        up = GaugeMetricFamily("rarecache_store_up", "1 if the row store's stats could be read", labels=[])
        try:
            per = self._read()
        except Exception as e:  # noqa: BLE001  (a store that is down is shown, not a failed scrape)
            log.warning("reading the row store's stats failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for key in STORE_COUNTS:
            fam = CounterMetricFamily(f"rarecache_store_{key}", f"row store {key}", labels=["model"])
            for model, stats in per.items():
                fam.add_metric([model], float(stats.get(key, 0)))
            yield fam
        for key in STORE_GAUGES:
            fam = GaugeMetricFamily(f"rarecache_store_{key}", f"row store {key} held now", labels=["model"])
            for model, stats in per.items():
                fam.add_metric([model], float(stats.get(key, 0)))
            yield fam

    def _read(self) -> dict[str, dict]:
        got = self.service.store_stats()
        models = got.get("models")
        return dict(models) if isinstance(models, dict) else {"all": got}


class Metrics:
    """One app's metrics: `observe` each answered request, `render` for a scrape."""

    def __init__(self, service: ChatBackend):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rarecache_requests", "chat requests answered, by handoff status",
                                ["model", "handoff"], registry=r)
        self.handoffs = Counter("rarecache_handoffs", "prompts handed off from another model", ["model"], registry=r)
        self.fallbacks = Counter("rarecache_handoff_fallbacks", "prompts the model read itself though it has a "
                                 "map into it, by reason", ["model", "reason"], registry=r)
        self.recomputed = Counter("rarecache_positions_recomputed", "handed-off positions the model recomputed",
                                  ["model"], registry=r)
        self.approximate = Counter("rarecache_approximate_reuses", "requests that reused rows an earlier "
                                   "handoff left (not the model's own)", ["model"], registry=r)
        self.ttft = Histogram("rarecache_ttft_seconds", "time to first token, from submission",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        r.register(_StoreCollector(service))
        for model in service.models:  # every series from the first scrape, at 0
            for status in STATUSES:
                self.requests.labels(model, status)
            for reason in REASONS:
                self.fallbacks.labels(model, reason)
            for c in (self.handoffs, self.recomputed, self.approximate, self.ttft):
                c.labels(model)

    def observe(self, model: str, info: dict[str, Any], seconds: dict[str, float]) -> None:
        """Count one answered request from its response's `rarecache` object (serve/outcome.py's fields)."""
        status = info.get("handoff")
        self.requests.labels(model, status).inc()
        if status == "applied":
            self.handoffs.labels(model).inc()
            self.recomputed.labels(model).inc(info.get("recomputed_tokens") or 0)
        elif status == "fallback_reprefill":
            self.fallbacks.labels(model, info.get("fallback_reason")).inc()
        if info.get("approximate_rows_reused"):
            self.approximate.labels(model).inc()
        if "first_token" in seconds:
            self.ttft.labels(model).observe(seconds["first_token"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
