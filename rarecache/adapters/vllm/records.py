"""The worker's record of a handoff, as a reader must check it before believing it.

The worker half files a record of each load a request asked about (worker.py `_record`), in
the row store, which any process with access to the directory could have written. What the
record says goes into an API response (handed off or not, from which model, how many
positions recomputed), so it is read as untrusted input: the right request, this engine's
model, a peer it takes handoffs from, the prompt that was sent, counts that are possible.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import RarecacheError
from .core import ENGINE_SELECTORS
from .store import RECORD_VERSION, same_model


def _whole(x: Any, low: int, high: int) -> bool:
    return type(x) is int and low <= x <= high


def check_record(rec: Any, name: str, model: dict[str, str], peers: dict[str, dict[str, str]], prompt_len: int,
                 block_size: int) -> dict[str, Any]:
    """A worker's record of one handoff (worker.py `_record`), checked against what the service asked:
    the record it named, this engine's model, one of its peers, the prompt it sent. Returns it."""
    def bad(why: str):
        raise RarecacheError(f"the engine's record of the handoff {why}")

    if not isinstance(rec, dict) or rec.get("format_version") != RECORD_VERSION or rec.get("record") != name:
        bad("is not a record of this request")
    if not isinstance(rec.get("model"), dict) or not same_model(rec["model"], model):
        bad("names another model")
    peer = rec.get("peer")
    if peer not in peers or not isinstance(rec.get("peer_model"), dict) \
            or not same_model(rec["peer_model"], peers[peer]):
        bad(f"names a peer this engine does not take handoffs from ({str(peer)[:64]!r})")
    if rec.get("prompt") != prompt_len:
        bad("is for another prompt length")
    rho = rec.get("rho")
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 <= rho <= 1 \
            or rec.get("selector") not in ENGINE_SELECTORS:
        bad("has no valid rho and selector")
    if rec.get("status") == "failed":
        if not isinstance(rec.get("error"), str):
            bad("says the load failed but not why")
        return rec
    if rec.get("status") != "handed_off":
        bad("has no valid status")
    n, k = rec.get("tokens"), rec.get("recomputed")
    if not _whole(n, 1, prompt_len - 1) or n % block_size or not _whole(k, 0, n):
        bad(f"holds impossible counts (tokens {str(n)[:20]}, recomputed {str(k)[:20]}, prompt {prompt_len})")
    seconds = rec.get("seconds")
    if not isinstance(seconds, dict) or set(seconds) != {"store_read", "map_and_recompute"} or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
            for v in seconds.values()):
        bad("has no valid timings")
    return rec
