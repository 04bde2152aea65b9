"""What became of a request's chance to hand off: the status a router reads from every response.

A router moving conversations between models needs to know, per response, whether the prompt's
rows came through a handoff, and if not why (vLLM RFC #44223 asks every reuse to report its status
and fallback reason). One of three statuses, whichever engine answered:

- `applied`: rows were handed off from another model (mapped, a share recomputed);
- `fallback_reprefill`: the model has a map into it, but read the prompt itself (its own held rows
  kept), for a `reason`: `no_entry` (no other model held a longer prefix of it), `identity_mismatch`
  (the rows found were filed by another model or map than the deployment's), `evicted` (they were,
  but were evicted), `store_down` (the row store could not be reached), `gate` (the quality gate
  refused the handoff) or `short_prompt` (a handoff was possible, but the prompt is shorter than the
  server's `min_handoff_tokens`: serve/settings.py `too_short`);
- `unsupported`: nothing can be handed off into this model (no map into it, or an engine that cannot).

Separately, `approximate_rows_reused` says whether the model reused rows an earlier handoff left (not
its own prefill's): approximate rows never count as an exact prefix hit, and a client is told; and an
applied handoff names the map that mapped the rows, `mapper_id` (the map file's sha256, where the server
knows the file).
The response's `rarecache` object carries these fields, and the `x-rarecache-handoff` header
the same in one line (`fallback_reprefill; reason=gate; approximate=0`); a service that knows them
once the prompt's rows are ready (`streams_outcome`, as ChatService) gives them to a stream's
headers too, through the `on_start` callback of its `answer`.

Router-facing names. vLLM semantic-router's cross-model KV contract (its issue #2976, the headers of
its pull request #3770) has a response header `x-vsr-kv-transfer-status` with the same three statuses
and the same meaning, and a request header `x-vsr-kv-mapper-id` naming the map a handoff is to use.
Every response carries the status under their name too (`headers`), an applied handoff its map under
`x-vsr-kv-mapper-id`, and a request naming a map (`ROUTER_MAPPER`) is handed off through that map only:
where the server has no map of that id into the model, the model reads the prompt itself
(fallback_reprefill, identity_mismatch), as their connector falls back on a mismatched mapper.
"""

from __future__ import annotations

from typing import Any

APPLIED, FALLBACK, UNSUPPORTED = "applied", "fallback_reprefill", "unsupported"
STATUSES = (APPLIED, FALLBACK, UNSUPPORTED)
REASONS = ("no_entry", "identity_mismatch", "evicted", "store_down", "gate", "short_prompt")
SHORT_PROMPT, IDENTITY_MISMATCH = "short_prompt", "identity_mismatch"
HEADER = "x-rarecache-handoff"
ROUTER_STATUS = "x-vsr-kv-transfer-status"  # semantic-router's name for `handoff` (a response header)
ROUTER_MAPPER = "x-vsr-kv-mapper-id"  # semantic-router's name for the map's id (request and response header)


def fields(status: str, reason: str | None, approximate: bool, mapper_id: str | None = None) -> dict[str, Any]:
    """The response's outcome fields, checked: a reason with fallback_reprefill only, one of REASONS; a map's
    id with applied only."""
    if status not in STATUSES or (status == FALLBACK) != (reason in REASONS) or (
            mapper_id is not None and status != APPLIED):
        raise ValueError(f"handoff status {status!r} with reason {reason!r}, map {mapper_id!r}")  # a service's bug
    return {"handoff": status, "fallback_reason": reason if status == FALLBACK else None,
            "approximate_rows_reused": bool(approximate), "mapper_id": mapper_id}


def outcome(reply: Any) -> dict[str, Any]:
    """The outcome fields of any engine's `Reply` (serve/job.py), as its service set them."""
    return fields(reply.handoff_status, reply.fallback_reason, reply.reused_approximate, reply.mapper_id)


def header(fields: dict[str, Any]) -> str:
    """The `x-rarecache-handoff` value of `fields`."""
    reason = f"; reason={fields['fallback_reason']}" if fields["fallback_reason"] else ""
    return f"{fields['handoff']}{reason}; approximate={int(fields['approximate_rows_reused'])}"


def headers(fields: dict[str, Any]) -> dict[str, str]:
    """A response's outcome headers: ours, and semantic-router's names for what means the same."""
    out = {HEADER: header(fields), ROUTER_STATUS: fields["handoff"]}
    if fields["mapper_id"] is not None:
        out[ROUTER_MAPPER] = fields["mapper_id"]
    return out
