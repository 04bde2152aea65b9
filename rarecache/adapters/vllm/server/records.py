"""The worker's record of a handoff, as a reader must check it before believing it, and the
outcome of a request's handoff that the service makes of it (`account`, `outcome`).

The worker half files a record of each load a request asked about (connector/worker_side.py `_record`), in
the row store, which any process with access to the directory could have written. What the
record says goes into an API response (handed off or not, from which model, how many
positions recomputed), so it is read as untrusted input: the right request, this engine's
model, a peer it takes handoffs from, the prompt that was sent, counts that are possible.
"""

from __future__ import annotations

import math
from typing import Any

from ....errors import RarecacheError
from ....serve.outcome import REASONS as SERVED_REASONS
from ..connector.core import ENGINE_SELECTORS
from ..rowstore.interface import REASONS, RECORD_VERSION, RowStore, same_model


def _whole(x: Any, low: int, high: int) -> bool:
    return type(x) is int and low <= x <= high


def check_record(rec: Any, name: str, model: dict[str, str], peers: dict[str, dict[str, str]], prompt_len: int,
                 block_size: int) -> dict[str, Any]:
    """A worker's record of one handoff (connector/worker_side.py `_record`), checked against what the service asked:
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
        if not isinstance(rec.get("error"), str) or rec.get("reason", "no_entry") not in REASONS:
            bad("says the load failed but not why")
        return rec
    if rec.get("status") != "handed_off":
        bad("has no valid status")
    n, k = rec.get("tokens"), rec.get("recomputed")
    if not _whole(n, 1, prompt_len - 1) or n % block_size or not _whole(k, 0, n):
        bad(f"holds impossible counts (tokens {str(n)[:20]}, recomputed {str(k)[:20]}, prompt {prompt_len})")
    if "bytes_read" in rec and not _whole(rec["bytes_read"], 0, 1 << 50):
        bad("has no valid byte count")
    seconds = rec.get("seconds")
    if not isinstance(seconds, dict) or set(seconds) != {"store_read", "map_and_recompute"} or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
            for v in seconds.values()):
        bad("has no valid timings")
    return rec


OUTCOMES = ("applied", "fallback_reprefill", "unsupported", "not_needed")


def outcome(status: str, reason: str | None = None, **more: Any) -> dict[str, Any]:
    """What happened to a request's handoff, in the store's words (`handoff_detail` of the response):
    applied (a peer's rows were reused), fallback_reprefill (the model read the prompt itself; reason:
    store.REASONS), unsupported (this model takes no handoffs, or the request asked for none),
    not_needed (the model's own rows covered the prompt at least as far)."""
    assert status in OUTCOMES
    return {"status": status, "reason": reason, **more}


def settle(reply: Any, detail: dict[str, Any]) -> None:
    """Give `reply` its outcome: `handoff` (the detail) and the serving layer's `handoff_status` and
    `fallback_reason` (serve/outcome.py's words, which every engine's response shares: own rows that
    covered the prompt are a fallback with no longer entry elsewhere, a corrupt entry a mismatch)."""
    status, reason = detail["status"], detail.get("reason")
    if status == "not_needed":
        status, reason = "fallback_reprefill", "no_entry"
    elif status == "fallback_reprefill":
        reason = {"corrupt_entry": "identity_mismatch"}.get(reason, reason)
        reason = reason if reason in SERVED_REASONS else "no_entry"
    else:
        reason = None
    reply.handoff, reply.handoff_status, reply.fallback_reason = detail, status, reason


def account(reply: Any, store: RowStore, record: str, model: dict[str, str], peers: dict[str, dict[str, str]],
            prompt_len: int, block_size: int, peer: str, scheduler: dict[str, Any], seconds: dict[str, float]) -> None:
    """Fill `reply` (serving.VllmReply) with what the handoff the service asked for did: the worker's
    record (taken from the store, checked), or the scheduler's reason when the engine did not hand off."""
    try:
        rec = store.take_record(record)
        if rec is not None:
            rec = check_record(rec, record, model, peers, prompt_len, block_size)
        claimed = scheduler.get("handoff")
        if rec is None and claimed:
            raise RarecacheError("is missing though the scheduler claimed the prompt")
        if rec is not None and rec["status"] == "handed_off" and isinstance(claimed, dict) and (
                claimed.get("peer"), claimed.get("tokens")) != (rec["peer"], rec["tokens"]):
            raise RarecacheError("disagrees with the scheduler's")
    except RarecacheError as e:  # rows may have been handed off: never reported as the model's own
        reply.handed_off_from, reply.prefilled = peer, None
        reply.note = f"{e}; whether the prompt was handed off is unknown"
        settle(reply, outcome("applied", None, approximate=True, verified=False))
        return
    if rec is None:
        reply.note = str(scheduler.get("reason") or scheduler.get("error") or "the engine did not hand it off")
        if scheduler.get("status") == "unsupported":
            settle(reply, outcome("unsupported", "engine", detail=reply.note[:300]))
        else:
            fallback = scheduler.get("fallback")
            settle(reply, outcome("fallback_reprefill", fallback if fallback in REASONS else "no_entry",
                                  detail=reply.note[:300]))
    elif rec["status"] == "failed":
        reply.note = f"the handoff failed and vLLM prefilled the prompt itself: {rec['error'][:300]}"
        settle(reply, outcome("fallback_reprefill", rec.get("reason", "no_entry"), detail=rec["error"][:300]))
    else:
        n = rec["tokens"]
        reply.handed_off_from, reply.handed_off, reply.recomputed = rec["peer"], n, rec["recomputed"]
        reply.rho, reply.selector = rec["rho"], rec["selector"]
        reply.reused = max(0, reply.reused - n)  # vLLM counts the claimed tokens as cached
        reply.prefilled = prompt_len - reply.reused - n
        seconds["handoff"] = sum(rec["seconds"].values())
        seconds["store_read"] = rec["seconds"]["store_read"]
        settle(reply, outcome("applied", None, approximate=n > rec["recomputed"], peer=rec["peer"],
                              bytes_read=rec.get("bytes_read")))
