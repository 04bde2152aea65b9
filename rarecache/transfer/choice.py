"""Choosing positions: the budget, orders built from scores, the top of an order, the chosen tokens,
and the clock the recompute's phases are timed by (`now`).

Every recompute schedule (one pass in `handoff.py`, two in `query.py`, the gate's rungs, the vLLM
adapter) spends ⌈ρ·T⌉ positions and takes them from one order over the handed-off positions. The
orders here are built from scores (B, W) over those positions, higher = earlier, and returned as
scores again, so `select_top` takes any budget's set from them:
- `lexicographic`: sort by several keys in turn (the first decides, the next breaks its ties);
- `in_turn`: two orders taken alternately (a position on both counts once, at its earlier turn);
- `spans`: each pick brings its neighbours (a fact is a line, not a token): a position's key is
  the best key within `span` positions of it, ties broken by its own key;
- `segments`: each pick brings its whole piece of text (`pieces`: a line or paragraph, cut to a length):
  a position's key is the best key in its piece, ties broken by its own key;
- `union_of_groups`: each group's (a layer's, a head's) top positions in turn, by the best place a
  position has in any group.
Kept light (torch only) so the selectors and the two-pass recompute both build on it.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


def budget(rho: float, length: int) -> int:
    """⌈ρ·T⌉ positions, at least the last one."""
    return max(1, math.ceil(rho * length - 1e-9))


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest of scores (W,), the last one forced in; ascending."""
    s = scores.clone().float()
    s[-1] = float("inf")
    return s.topk(k).indices.sort().values


def subset(tokens: torch.Tensor, chosen: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole prompts (B, n) and each row's chosen positions -> their tokens and positions (B, K), -1 padded."""
    width = max(len(c) for c in chosen)
    positions = torch.full((len(chosen), width), -1, dtype=torch.long, device=tokens.device)
    for b, c in enumerate(chosen):
        positions[b, : len(c)] = c
    return tokens.gather(1, positions.clamp(min=0)), positions


def now(device: torch.device) -> float:
    """A clock for a phase on `device`: on a GPU, after its queued kernels (timed to completion, not launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def order_rank(scores: torch.Tensor) -> torch.Tensor:
    """Each position's place (0 = first) when a row (B, W) is sorted by score, highest first (ties: by index)."""
    order = scores.argsort(dim=1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(1, order, torch.arange(scores.shape[1], device=scores.device)
                                            .expand_as(order).contiguous())


def from_rank(place: torch.Tensor) -> torch.Tensor:
    """Places (B, W) (0 = first) -> scores, higher first."""
    return (place.shape[1] - place).float()


def lexicographic(*keys: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) ordering positions by keys[0] (higher first), its ties by keys[1], ...; ties of all: by index."""
    order = torch.arange(keys[0].shape[1], device=keys[0].device).expand_as(keys[0])
    for key in reversed(keys):  # stable sorts, least significant key first
        order = order.gather(1, key.gather(1, order).argsort(dim=1, descending=True, stable=True))
    place = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                             .expand_as(order).contiguous())
    return from_rank(place)


def in_turn(first: torch.Tensor, second: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) taking the highest of `first` and of `second` in turn, `first`'s first (a position on
    both lists counts once, at its earlier turn); `pad` (B, W) positions last, at 0."""
    a = order_rank(first.float().masked_fill(pad, float("-inf")))
    b = order_rank(second.float().masked_fill(pad, float("-inf")))
    turn = torch.minimum(2 * a, 2 * b + 1)
    return (2 * pad.shape[1] - turn).float().masked_fill(pad, 0.0)  # positive, padding last


def spans(key: torch.Tensor, span: int, eligible: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) over consecutive positions in which each position of a high key brings the `span`
    positions on either side: a position's first key is the best eligible key within `span` of it, its
    own key breaks ties (so a budget cut inside a span keeps the span's best). Ineligible positions get
    no span and come last."""
    k = key.float().masked_fill(~eligible, float("-inf"))
    if span <= 0:
        return lexicographic(k)
    pooled = F.max_pool1d(k[:, None], 2 * span + 1, stride=1, padding=span)[:, 0]  # (B, W)
    return lexicographic(pooled.masked_fill(~eligible, float("-inf")), k)


def pieces(ends: torch.Tensor, cap: int) -> torch.Tensor:
    """Piece ids (B, W), rising along each row, for consecutive positions cut after every `ends` (B, W) position
    (a segment's last: its line break) and every `cap` positions within a segment."""
    B, W = ends.shape
    index = torch.arange(W, device=ends.device).expand(B, W)
    opens = F.pad(ends[:, :-1], (1, 0), value=True)  # (B, W): a segment starts here
    start = torch.where(opens, index, 0).cummax(1).values  # its segment's first position
    return (((index - start) % cap) == 0).long().cumsum(1) - 1


def segments(key: torch.Tensor, piece: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) in which each position of a high key brings its whole piece (`pieces`): a position's first
    key is the best eligible key in its piece, the earlier piece breaks a tie between pieces (they come whole,
    not interleaved), its own key breaks ties within one (a budget cut inside a piece keeps the piece's best).
    Ineligible positions come last."""
    k = key.float().masked_fill(~eligible, float("-inf"))
    best = torch.full_like(k, float("-inf")).scatter_reduce(1, piece, k, "amax")  # (B, W) per piece id
    return lexicographic(best.gather(1, piece).masked_fill(~eligible, float("-inf")), -piece.float(), k)


def union_of_groups(att: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) from per-group scores att (B, G, W): the union of each group's top positions, grown
    evenly (every group's first, then every group's second, ...): a position's first key is its best
    place in any group, the groups' sum breaks ties. Ineligible positions last."""
    B, G, W = att.shape
    masked = att.float().masked_fill(~eligible[:, None], float("-inf"))
    places = order_rank(masked.reshape(B * G, W)).view(B, G, W)
    best = places.min(1).values  # (B, W)
    total = masked.sum(1)  # -inf where ineligible
    return lexicographic((-best.float()).masked_fill(~eligible, float("-inf")), total)
