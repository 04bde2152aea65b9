"""What became of a request's chance to hand off: the status a router reads from every response.

A router moving conversations between models needs to know, per response, whether the prompt's
rows came through a handoff, and if not why (vLLM RFC #44223 asks every reuse to report its status
and fallback reason). One of three statuses, whichever engine answered:

- `applied`: rows were handed off from another model (mapped, a share recomputed);
- `fallback_reprefill`: the model has a map into it, but read the prompt itself (its own held rows
  kept), for a `reason`: `no_entry` (no other model held a longer prefix of it), `identity_mismatch`
  (the rows found were filed by another model or map than the deployment's), `evicted` (they were,
  but were evicted), `store_down` (the row store could not be reached) or `gate` (the quality gate
  refused the handoff);
- `unsupported`: nothing can be handed off into this model (no map into it, or an engine that cannot).

Separately, `approximate_rows_reused` says whether the model reused rows an earlier handoff left (not
its own prefill's): approximate rows never count as an exact prefix hit, and a client is told.
The response's `rarecache` object carries all three fields, and the `x-rarecache-handoff` header
the same in one line (`fallback_reprefill; reason=gate; approximate=0`); a service that knows them
once the prompt's rows are ready (`streams_outcome`, as ChatService) gives them to a stream's
headers too, through the `on_start` callback of its `answer`.
"""

from __future__ import annotations

from typing import Any

APPLIED, FALLBACK, UNSUPPORTED = "applied", "fallback_reprefill", "unsupported"
STATUSES = (APPLIED, FALLBACK, UNSUPPORTED)
REASONS = ("no_entry", "identity_mismatch", "evicted", "store_down", "gate")
HEADER = "x-rarecache-handoff"


def fields(status: str, reason: str | None, approximate: bool) -> dict[str, Any]:
    """The response's three fields, checked: a reason with fallback_reprefill only, one of REASONS."""
    if status not in STATUSES or (status == FALLBACK) != (reason in REASONS):
        raise ValueError(f"handoff status {status!r} with reason {reason!r}")  # a bug of the service's
    return {"handoff": status, "fallback_reason": reason if status == FALLBACK else None,
            "approximate_rows_reused": bool(approximate)}


def outcome(reply: Any, mappable: bool) -> dict[str, Any]:
    """The response fields for `reply` (duck-typed: any engine's Reply): its own `handoff_status` and
    `fallback_reason` when its service set them, else read from what it did. `mappable`: whether some
    model has a map into the reply's model on this server."""
    status, reason = getattr(reply, "handoff_status", None), getattr(reply, "fallback_reason", None)
    if status is None:
        if getattr(reply, "handed_off_from", None) is not None:  # (rows that may be mapped are never "own")
            status = APPLIED
        elif mappable:
            status, reason = FALLBACK, reason or "no_entry"
        else:
            status = UNSUPPORTED
    return fields(status, reason, getattr(reply, "reused_approximate", 0))


def header(fields: dict[str, Any]) -> str:
    """The `x-rarecache-handoff` value of `outcome`'s fields."""
    reason = f"; reason={fields['fallback_reason']}" if fields["fallback_reason"] else ""
    return f"{fields['handoff']}{reason}; approximate={int(fields['approximate_rows_reused'])}"
