"""Query-aware recompute: the question chooses which mapped rows the target recomputes, in two passes.

In a long prompt the newest positions are the question, and the content it asks about sits in
mapped rows; which of them matter depends on the question. So ask it (docs/ARCHITECTURE.md,
/work/shared/design.md "Long context"):
- pass 1 recomputes the newest w positions (the question and the answer header) over the mapped
  cache, capturing the target's own attention from those queries to every position;
- pass 2 recomputes the positions those queries attend to most, ordered by the selector
  (`selectors.QuerySelector.order`: summed or per layer / head, spans, sinks left out, ...), and
  the newest w again: they must see the rows pass 2 made exact, and their own rows from pass 1 read
  mapped rows below them.
Both passes count in the budget: w + (w + k) = ⌈ρ·T⌉ (`QueryConfig.split`; one pass when the
budget covers the span, so ρ 1 is the target's own prefill, or when two passes do not fit).

Pass 2 runs every chosen position through every layer, and each layer writes a position's row
before any query reads it; the window is inside pass 2's set. So a handoff's result is exactly a
direct sparse recompute of pass 2's set from the mapped cache: pass 1 only chose the set (tested
bit for bit). That is also why `handoff_variants` may run pass 2 in a shared batch, and why vLLM
may run the newest positions itself (`before_tail`: pass 1 is the engine's tail computed by our
Runner over the mapped rows, pass 2 the chosen claimed rows, then vLLM's own prefill of the tail).

A refining variant (`QueryConfig.refine`) reads twice. Pass 1's attention comes from queries computed
over mapped rows and lands on mapped keys, so it is a blurred copy of what the target's own prefill
reads. A refining pass recomputes the window and the top share m of the picks, the window's attention
is read again over those rows, and the last pass recomputes the window and the rest of the picks by
that second reading. The refining pass's rows stay (they are not recomputed again), so its result is
staged: exactly a direct sparse recompute of (its picks + the window) from the mapped cache, then one of
(the rest + the window) from that (tested bit for bit), with w + (w + m) + (w + rest) = ⌈ρ·T⌉.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.cache import KVCache
from ..engine.runner import AttnCapture, Runner
from .choice import budget, now, select_top, subset
from .selectors import QuerySelector


@dataclass
class Passes:
    """What a two-pass selector chose for a batch, before its last pass runs."""

    chosen: list[torch.Tensor]  # per row: the last pass's positions, ascending (pass 1's among them)
    first: list[torch.Tensor]  # per row: pass 1's positions, ascending (empty: one pass)
    scores: torch.Tensor  # (B, W) the order over the handed-off positions (higher first)
    timings: dict[str, float] = field(default_factory=dict)
    kept: list[torch.Tensor] | None = None  # refining variants, per row: the picks the refining pass recomputed

    def recomputed(self, b: int) -> tuple[list[int], list[int]]:
        """Row b's positions whose rows the passes leave recomputed (ascending), and the window's positions
        each earlier pass recomputed again (pass 1's; a refining pass's too): every position counted once per
        pass, as `HandoffResult` records them."""
        kept = self.kept[b] if self.kept is not None else self.chosen[b][:0]
        first = self.first[b].tolist()
        again = first if len(kept) else []  # the refining pass recomputed the window too
        return sorted(self.chosen[b].tolist() + kept.tolist()), first + again


def timed_passes(sel) -> tuple[str, ...]:
    """The recompute passes a handoff by selector `sel` times apart, in order (none for a one-pass selector):
    `Passes.timings` holds each of them, the last ("pass2") added by whoever runs it."""
    if sel is None or not sel.two_pass:
        return ()
    return ("pass1", "refine", "pass2") if sel.config.refine else ("pass1", "pass2")


def captured_layers(target: Runner, share: float) -> frozenset[int]:
    """The top `share` of the target's layers (at least one), as `selectors.attention_capture` reads them."""
    L = target.num_layers
    return frozenset(range(L - max(1, int(share * L)), L))


def first_pass(target: Runner, cache: KVCache, whole: torch.Tensor, window: torch.Tensor, layers: frozenset[int]
               ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Recompute `window` (B, R) positions (-1 padded) over `cache`, capturing every one of their queries'
    attention in `layers` -> ({layer: (B, H, R, S)}, valid (B, R))."""
    rows = torch.arange(window.shape[1], device=window.device).expand_as(window)  # (B, R): every query of the pass
    out = target.forward(whole.gather(1, window.clamp(min=0)), window, cache, logits_at=None,
                         capture=AttnCapture(layers, rows))
    return out.attn, window >= 0


def received_by(sel: QuerySelector, attn: dict[int, torch.Tensor], valid: torch.Tensor, cache: KVCache,
                positions: torch.Tensor) -> torch.Tensor:
    """Attention the valid queries give positions (B, W), per group of `sel`'s (one, a layer or a (layer,
    head)) -> (B, G, W); with `value`, each weight times the norm of the value row it reads; with `common`,
    less what every query gives the position."""
    cfg, per = sel.config, []
    live = valid[:, None, :, None]  # (B, 1, R, 1)
    for layer in sorted(attn):
        p = attn[layer].float() * live  # (B, H, R, S)
        if cfg.common:
            floor = attn[layer].float().masked_fill(~live, float("inf")).amin(2, keepdim=True)  # (B, H, 1, S)
            p = (p - floor).clamp(min=0) * live
        a = p.sum(2)  # (B, H, S)
        if cfg.value:
            norm = cache.v[layer, :, :, : a.shape[-1]].float().norm(dim=-1)  # (B, Hkv, S)
            a = a * norm.repeat_interleave(a.shape[1] // norm.shape[1], dim=1)
        idx = positions.clamp(min=0)[:, None].expand(-1, a.shape[1], -1)  # (B, H, W)
        per.append(a.gather(2, idx) * (positions >= 0)[:, None])
    att = torch.stack(per, 1)  # (B, L, H, W)
    B, L, H, W = att.shape
    if cfg.group == "sum":
        return att.sum((1, 2))[:, None]
    return att.sum(2) if cfg.group == "layer" else att.reshape(B, L * H, W)


def plan(sel: QuerySelector, rho: float, handed: list[int]) -> tuple[list[int], list[int]]:
    """Per row of `handed` positions: the budget ⌈ρ·T⌉ and pass 1's share of it (0: one pass)."""
    totals = [budget(rho, h) for h in handed]
    return totals, [sel.config.split(k, h) for k, h in zip(totals, handed)]


def newest(positions: torch.Tensor, handed: list[int], widths: list[int]) -> torch.Tensor:
    """The last widths[b] of each row's handed-off positions (B, W) -> (B, max width), -1 padded."""
    out = torch.full((len(handed), max(widths, default=0)), -1, dtype=torch.long, device=positions.device)
    for b, (h, w) in enumerate(zip(handed, widths)):
        out[b, :w] = positions[b, h - w : h]
    return out


def choose(target: Runner, cache: KVCache, whole: torch.Tensor, positions: torch.Tensor, handed: list[int],
           sel: QuerySelector, rho: float, rank: torch.Tensor | None = None,
           done: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None, refined: KVCache | None = None,
           source: torch.Tensor | None = None) -> Passes:
    """Pass 1 over `cache` (the mapped cache: its window rows become pass 1's) and the last pass's sets for
    handed-off positions (B, W) (the first handed[b] of row b), whole prompts (B, n). `rank` (B, W): rank
    disagreement, for `rank` variants. `done`: pass 1's capture, when the caller ran it on this cache.
    A refining variant runs its refining pass into `refined` (default `cache`): the last pass starts there.
    `source` (B, W): the source's attention at the positions, for `blend` variants."""
    totals, widths = plan(sel, rho, handed)
    window = newest(positions, handed, widths)  # (B, w)
    refines = {"refine": 0.0} if sel.config.refine else {}  # a refining variant's pass is always timed (0: none ran)
    timings = {"pass1": 0.0, **refines}
    scores = positions.float()  # one pass: the newest first (every position when the budget covers them)
    kept = None
    if any(widths):
        t = now(target.device)
        attn, valid = done if done is not None else first_pass(target, cache, whole, window,
                                                                captured_layers(target, sel.config.layers))
        t1 = now(target.device)
        forced = torch.zeros_like(positions, dtype=torch.bool)
        for b, (h, w) in enumerate(zip(handed, widths)):
            forced[b, h - w : h] = True
        ranked = sel.order(received_by(sel, attn, valid, cache, positions), positions, forced, rank, source=source)
        scores = torch.where(torch.tensor(widths, device=positions.device)[:, None] > 0, ranked, scores)
        timings = {"pass1": t1 - t, "score": now(target.device) - t1, **refines}
        if sel.config.refine:
            kept, scores = refine(target, cache if refined is None else refined, whole, positions, handed, totals,
                                  widths, sel, scores, forced, rank, timings)
    chosen = []
    for b, (h, k, w) in enumerate(zip(handed, totals, widths)):
        m = 0 if kept is None else len(kept[b])
        picked = positions[b, select_top(scores[b, :h], k - w - (w if m else 0))]  # the window, kept ones, rest
        chosen.append(picked[~torch.isin(picked, kept[b])] if m else picked)
    return Passes(chosen, [window[b, :w] for b, w in enumerate(widths)], scores, timings, kept)


def refine(target: Runner, cache: KVCache, whole: torch.Tensor, positions: torch.Tensor, handed: list[int],
           totals: list[int], widths: list[int], sel: QuerySelector, ranked: torch.Tensor, forced: torch.Tensor,
           rank: torch.Tensor | None, timings: dict[str, float]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The refining pass, one forward per row (batches are a server's rare case: `Pipeline` hands requests off one
    at a time) into `cache`: the window and the top m of pass 1's order `ranked` (B, W),
    then the window's attention read again over them -> (per row the m kept picks, ascending; the order (B, W)
    with the window and the kept picks first). A row whose budget leaves no picks to refine keeps `ranked`."""
    t = now(target.device)
    kept, scores = [], ranked.clone()
    layers = captured_layers(target, sel.config.layers)
    for b, (h, k, w) in enumerate(zip(handed, totals, widths)):
        m = sel.config.refined(k, w)
        if not m:
            kept.append(positions[b, :0])
            continue
        top = positions[b, select_top(ranked[b, :h], w + m)]  # (w + m,) ascending: the window last
        row = cache.row(b)
        rows = torch.arange(m, m + w, device=top.device)[None]  # (1, w): the window's queries
        attn = target.forward(whole[b : b + 1, top], top[None], row, logits_at=None,
                              capture=AttnCapture(layers, rows)).attn
        again = forced[b : b + 1] | torch.isin(positions[b : b + 1], top)  # (1, W)
        valid = torch.ones(1, w, dtype=torch.bool, device=top.device)
        att = received_by(sel, attn, valid, row, positions[b : b + 1])
        scores[b] = sel.order(att, positions[b : b + 1], again, None if rank is None else rank[b : b + 1])[0]
        kept.append(top[:m])
    timings["refine"] = now(target.device) - t
    return kept, scores


def two_pass(target: Runner, cache: KVCache, whole: torch.Tensor, positions: torch.Tensor, handed: list[int],
             sel: QuerySelector, rho: float, rank: torch.Tensor | None = None, source: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, Passes]:
    """Both passes over the mapped `cache` (arguments as `choose`) -> the last logits (B, V) and the passes;
    `cache` ends as a direct sparse recompute of pass 2's set from the mapped cache (a refining variant: of the
    refining pass's set, then of the last pass's from there; the module docstring)."""
    passes = choose(target, cache, whole, positions, handed, sel, rho, rank, source=source)
    t = now(target.device)
    tokens, pos = subset(whole, passes.chosen)
    logits = target.forward(tokens, pos, cache).logits
    passes.timings["pass2"] = now(target.device) - t
    return logits, passes


def before_tail(target: Runner, cache: KVCache, whole: torch.Tensor, start: int, k: int, sel: QuerySelector,
                rank: torch.Tensor | None = None) -> torch.Tensor:
    """An engine that computes the prompt's tail [start, P) itself after the claimed rows [0, start) (vLLM):
    pass 1 is the tail, computed here over the mapped claimed rows of `cache` (batch one) with every one of
    its queries captured; returns the k claimed positions (ascending) pass 2 recomputes, before the engine's
    own prefill of the tail (the newest again). Equal to `choose` with the tail as the window."""
    P = whole.shape[1]
    tail = torch.arange(start, P, device=whole.device)[None]  # (1, P - start)
    attn, valid = first_pass(target, cache, whole, tail, captured_layers(target, sel.config.layers))
    positions = torch.arange(start, device=whole.device)[None]  # (1, start): the claimed positions
    scores = sel.order(received_by(sel, attn, valid, cache, positions), positions, None, rank)[0]
    return scores.topk(min(k, start)).indices.sort().values
