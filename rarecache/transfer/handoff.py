"""The handoff pipeline: source cache -> map -> score -> selective recompute -> target cache.

The target cache starts as the mapped cache at every handed-off position. The
target then runs its layers over the selected positions only, at their true
positions: each layer overwrites those rows with its own k, v and attends over
the whole mixed cache by the exact causal rule. The last prompt position is
always selected (it yields the first token's logits) and counts inside the
budget. ρ = 1 reproduces the target's own prefill (and maps and scores nothing: no mapped row
would be read); ρ = 0 is plain transfer.

A handoff can start mid-conversation: the source cache may already hold the
first `source_kept` positions (only the rest is prefilled), and the target cache
may already hold its own rows for the first `target_kept` positions (only the rest
is mapped, scored and selected from).

Two schedules spend the budget. `positions` (the default) recomputes the ⌈ρ·T⌉
positions a selector picks through all the target's layers. `layer-prefix`
(DroidSpeak-style) is not a choice of positions: it runs the target's first m
layers for every handed-off position, m FLOP-matched to ρ. Users name either by
one word (`--selector layer-prefix`, arm `0.3:layer-prefix`): `HandoffConfig.named`
reads it and `HandoffConfig.name` gives it back. A query-aware selector (`query`, ...) spends the
positions budget in two passes, its first choosing from the target's own attention what its second
recomputes (transfer/query.py); both count in the ⌈ρ·T⌉ (`HandoffResult.recomputed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..defaults import SERVED
from ..engine.cache import KVCache
from ..engine.runner import Runner, Step, spans
from ..errors import RarecacheError
from ..registry import LAYER_PREFIX
from .choice import budget, now, select_top, subset
from .mapper import Mapper
from .query import captured_layers, choose, first_pass, newest, plan, timed_passes, two_pass
from .selectors import ATTN_QUERIES, SELECTORS, SelectionContext, Selector, forward_received, read_at

POSITIONS = "positions"  # the selector's ⌈ρ·T⌉ positions through all the target's layers
# LAYER_PREFIX (registry.py, where selectors are named): the target's first m layers for every position, m
# FLOP-matched to ρ
SCHEDULES = (POSITIONS, LAYER_PREFIX)


def check_rho(rho, where: str = "rho") -> float:
    """A share of positions: a number in [0, 1] (not a bool, not NaN), or a clear error naming `where`."""
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 <= rho <= 1:
        raise RarecacheError(f"{where} must be a number in [0, 1], got {rho!r}")
    return float(rho)


@dataclass(frozen=True)
class HandoffConfig:
    rho: float = SERVED.rho  # share of handed-off positions the target recomputes (layer-prefix: its FLOPs)
    selector: str = SERVED.selector  # which positions, under the positions schedule
    seed: int = 0  # for the random selector
    schedule: str = POSITIONS

    def __post_init__(self):
        check_rho(self.rho)
        if self.schedule not in SCHEDULES:
            raise RarecacheError(f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        if self.selector not in SELECTORS:
            hint = f" ({LAYER_PREFIX} is a schedule: schedule={LAYER_PREFIX!r})" if self.selector == LAYER_PREFIX else ""
            raise RarecacheError(f"unknown selector {self.selector!r}; choose from {', '.join(SELECTORS)}{hint}")

    @classmethod
    def named(cls, rho: float, name: str, seed: int = 0) -> HandoffConfig:
        """The config a user names by one word (CLI flags, eval arms, results files): a selector's
        name, or layer-prefix."""
        if name == LAYER_PREFIX:
            return cls(rho, seed=seed, schedule=LAYER_PREFIX)
        if name in SELECTORS:
            return cls(rho, name, seed)
        cls(rho)  # a bad rho is reported first, as the constructor does
        raise RarecacheError(f"unknown selector {name!r}; choose from {', '.join([*SELECTORS, LAYER_PREFIX])}")

    @property
    def name(self) -> str:
        """The one word `named` reads: the selector's name, or the schedule's when it is not positions."""
        return self.selector if self.schedule == POSITIONS else self.schedule

    @property
    def scorer(self) -> Selector | None:
        """The selector that scores positions; None under layer-prefix, which scores none."""
        return SELECTORS[self.selector] if self.schedule == POSITIONS else None


@dataclass
class HandoffResult:
    """What one handoff did, per request."""

    positions: list[list[int]]  # positions the target recomputed through all its layers, ascending
    scores: list[torch.Tensor] | None  # selector score per handed-off position, if the selector has one
    handed_off: list[tuple[int, int]]  # [target_kept, end) of the positions that came from the map
    prefix_layers: int | None = None  # layer-prefix: layers the target ran for every position
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    # two-pass selectors: pass 1's positions (inside `positions`), listed again for a refining pass (which
    # recomputed them too): the passes before the last, as many times as they recomputed them
    first_pass: list[list[int]] | None = None

    def recomputed(self, b: int = 0) -> int:
        """Positions request b recomputed through all the target's layers, every pass counted."""
        return len(self.positions[b]) + (len(self.first_pass[b]) if self.first_pass else 0)


def _now(runner: Runner) -> float:
    return now(runner.device)


def recomputes_all(cfg: HandoffConfig, widths: list[int]) -> bool:
    """Whether the budget recomputes every handed-off position of spans `widths` wide (ρ 1, or a
    one-position span): then nothing the map writes is ever read, and `handoff` maps and scores nothing."""
    return cfg.schedule == POSITIONS and all(budget(cfg.rho, w) >= w for w in widths)


def prefix_layers(rho: float, length: int, layers: int) -> int:
    """Layers to run for every position so layer-prefix costs what ⌈ρT⌉ positions x all layers cost."""
    if length <= 1:
        return layers
    k = budget(rho, length)
    return min(layers, max(0, round((k - 1) * layers / (length - 1))))


@dataclass
class Mapped:
    """A batch after the map and the selector's scores, before any recompute: what `handoff` and the
    gated ladder (`gate/ladder.py`) both start from."""

    cache: KVCache  # target cache: mapped rows at the handed-off positions
    whole: torch.Tensor  # (B, n) whole prompts
    tokens: torch.Tensor  # (B, W) handed-off tokens
    positions: torch.Tensor  # (B, W) handed-off positions, -1 padded
    scores: torch.Tensor | None  # (B, W) selector scores; None under layer-prefix
    lengths: list[int]
    target_kept: list[int]
    source_attn: torch.Tensor | None  # (B, S) attention received in the source, if captured
    timings: dict[str, float]
    rank: torch.Tensor | None = None  # (B, W) rank disagreement, when the selector reads it


def map_and_score(source: Runner, target: Runner, mapper: Mapper, prompts: list[list[int]], cfg: HandoffConfig,
                  max_len: int | None = None, source_cache: KVCache | None = None,
                  source_kept: list[int] | None = None, target_cache: KVCache | None = None,
                  target_kept: list[int] | None = None, source_attn: torch.Tensor | None = None,
                  target_prefill: tuple[KVCache, torch.Tensor] | None = None, mapped: bool = True) -> Mapped:
    """The source prefills what it has not seen, the map fills the target cache, the selector scores
    the handed-off positions (arguments as `handoff`). At rho 0 the map's plain-transfer view maps
    (`Mapper.at_rho`). `mapped` False (every position is about to be recomputed): the source still
    prefills, nothing is mapped or scored (scores None)."""
    mapper = mapper.at_rho(cfg.rho)
    B, lengths = len(prompts), [len(p) for p in prompts]
    source_kept = source_kept or [0] * B
    target_kept = target_kept or [0] * B
    if (any(not 0 <= s < n for s, n in zip(target_kept, lengths))
            or any(not 0 <= s <= n for s, n in zip(source_kept, lengths))):
        raise RarecacheError("handoff spans must lie inside the prompts and leave at least one position")
    selector = cfg.scorer if mapped else None
    timings: dict[str, float] = {}
    device = target.device
    if selector and selector.needs_source_attention and source_attn is None:
        # the source's last ATTN_QUERIES queries, as a whole prefill captures them: a source that holds more of the
        # prompt computes its last rows again (the same rows), so a held prompt scores as a fresh one does
        source_kept = [min(f, max(0, n - ATTN_QUERIES)) for f, n in zip(source_kept, lengths)]

    t = _now(target)
    if source_cache is None:
        source_cache = source.new_cache(B, max_len or max(lengths))
    src_attn = source_attn
    if any(f < n for f, n in zip(source_kept, lengths)):
        toks, pos = spans(prompts, [min(f, n - 1) for f, n in zip(source_kept, lengths)], source.device)
        if selector and selector.needs_source_attention:
            _, src_attn = forward_received(source, toks, pos, source_cache, (pos >= 0).sum(1), max(lengths),
                                           logits_at=None)
        else:
            source.forward(toks, pos, source_cache, logits_at=None)
    timings["source_prefill"] = _now(target) - t

    t = _now(target)
    cache = target_cache or target.new_cache(B, max_len or max(lengths))
    toks, positions = spans(prompts, target_kept, device)
    needs_rank = selector is not None and selector.needs_rank  # rank disagreement is computed inside the map
    rank = mapper.apply_scored(source, source_cache, target, cache, positions, rank=needs_rank,
                               tokens=toks) if mapped else None
    timings["map"] = _now(target) - t

    t = _now(target)
    whole = spans(prompts, [0] * B, device)[0]  # (B, n)
    scores = None
    if selector is not None and not selector.two_pass:  # a two-pass selector scores after its first pass
        ctx = SelectionContext(source, target, mapper, whole, positions, cache, None, src_attn, cfg.seed,
                               target_prefill, rank=rank)
        scores = selector.scores(ctx)  # (B, W)
    timings["score"] = _now(target) - t
    return Mapped(cache, whole, toks, positions, scores, lengths, target_kept, src_attn, timings, rank)


@torch.inference_mode()
def handoff(source: Runner, target: Runner, mapper: Mapper, prompts: list[list[int]],
            cfg: HandoffConfig = HandoffConfig(), max_len: int | None = None,
            source_cache: KVCache | None = None, source_kept: list[int] | None = None,
            target_cache: KVCache | None = None, target_kept: list[int] | None = None,
            source_attn: torch.Tensor | None = None, target_prefill: tuple[KVCache, torch.Tensor] | None = None,
            ) -> tuple[KVCache, torch.Tensor, HandoffResult]:
    """Hand a batch of prompts from source to target.

    Returns the target cache (every prompt position filled), the target's logits at
    each prompt's last position (B, V), and the record of what was done.
    `source_kept` / `target_kept`: per prompt, the first positions `source_cache` /
    `target_cache` already hold (default none). Work done elsewhere can be passed in:
    `source_attn` (B, S) attention received in a source prefill that already happened
    (for attn-source), and `target_prefill`, the target's own prefill cache and
    attention received (for the oracles).
    """
    everything = recomputes_all(cfg, [len(p) - s for p, s in zip(prompts, target_kept or [0] * len(prompts))])
    m = map_and_score(source, target, mapper, prompts, cfg, max_len, source_cache, source_kept, target_cache,
                      target_kept, source_attn, target_prefill, mapped=not everything)
    cache, whole, positions, timings, lengths = m.cache, m.whole, m.positions, m.timings, m.lengths
    if cfg.schedule == LAYER_PREFIX:
        return _layer_prefix(target, prompts, cfg, cache, m.tokens, positions, m.target_kept, timings)
    if cfg.scorer.two_pass:
        return _two_pass(target, m, cfg)
    t = _now(target)
    scores, target_kept = m.scores, m.target_kept
    chosen = [torch.arange(s, n, device=whole.device) if everything else
              s + select_top(scores[b, : n - s], budget(cfg.rho, n - s))
              for b, (s, n) in enumerate(zip(target_kept, lengths))]
    timings["score"] += _now(target) - t

    t = _now(target)
    sel_tokens, sel_pos = subset(whole, chosen)
    logits = target.forward(sel_tokens, sel_pos, cache).logits
    timings["recompute"] = _now(target) - t
    per_request = None if scores is None else [scores[b, : n - s].cpu() for b, (s, n) in
                                               enumerate(zip(target_kept, lengths))]
    return cache, logits, HandoffResult([c.tolist() for c in chosen], per_request, list(zip(target_kept, lengths)),
                                        timings=timings)


def _two_pass(target: Runner, m: Mapped, cfg: HandoffConfig):
    """A query-aware selector's two passes over the mapped cache (transfer/query.py), both in the budget."""
    handed = [n - s for s, n in zip(m.target_kept, m.lengths)]
    source = None if m.source_attn is None else read_at(m.source_attn, m.positions)  # (B, W): a blend's
    logits, p = two_pass(target, m.cache, m.whole, m.positions, handed, cfg.scorer, cfg.rho, m.rank, source)
    passes = timed_passes(cfg.scorer)
    timings = {**m.timings, **{k: p.timings[k] for k in passes}}
    timings["score"] += p.timings.get("score", 0.0)
    timings["recompute"] = sum(p.timings[k] for k in passes)
    done = [p.recomputed(b) for b in range(len(handed))]
    return m.cache, logits, HandoffResult([d[0] for d in done], [p.scores[b, :h].cpu() for b, h in
                                          enumerate(handed)], list(zip(m.target_kept, m.lengths)), timings=timings,
                                          first_pass=[d[1] for d in done])


def _layer_prefix(target: Runner, prompts, cfg, cache, toks, positions, target_kept, timings):
    """DroidSpeak-style: the target's first m layers for every handed-off position (FLOP-matched
    to ρ), mapped KV above; the last position runs through all layers."""
    t = _now(target)
    lengths = [len(p) for p in prompts]
    m = min(prefix_layers(cfg.rho, n - s, target.num_layers) for s, n in zip(target_kept, lengths))
    step = Step.of(positions)  # (read on the host once, as a forward pass does)
    cache.mark(positions, step.top)
    step = target.planned(step, positions, cache)
    h = target.embed(toks)
    cos_sin = target.cos_sin(positions)
    for i in range(m):
        h, _ = target.layer(i, h, positions, cache, cos_sin, step=step)
    last = (positions >= 0).sum(1) - 1  # (B,)
    h = h[torch.arange(len(prompts)), last][:, None]  # (B, 1, C)
    pos = positions[torch.arange(len(prompts)), last][:, None]  # (B, 1)
    cos_sin, step = target.cos_sin(pos), Step.of(pos)
    step = target.planned(step, pos, cache)
    for i in range(m, target.num_layers):
        h, _ = target.layer(i, h, pos, cache, cos_sin, step=step)
    logits = target.logits(h, pos)
    timings["score"] = 0.0
    timings["recompute"] = _now(target) - t
    chosen = [[n - 1] for n in lengths]
    return cache, logits, HandoffResult(chosen, None, list(zip(target_kept, lengths)), prefix_layers=m,
                                        timings=timings)


def _first_pass_of(target: Runner, firsts: dict, fit: int, cache: KVCache, whole: torch.Tensor,
                   positions: torch.Tensor, sel, rho: float) -> tuple[KVCache, tuple | None, dict]:
    """Pass 1 of a two-pass variant on a copy of its map's cache, run once per (map, window, layers):
    (the cache as pass 1 left it, its capture or None for one pass, {"pass1": seconds})."""
    n = whole.shape[1]
    width = plan(sel, rho, [n])[1][0]
    if not width:
        return cache, None, {"pass1": 0.0}
    key = (fit, width, sel.config.layers)
    if key not in firsts:
        t = _now(target)
        row = target.new_cache(1, n)
        row.copy_prefix(cache, n)
        window = newest(positions, [n], [width])  # (1, width)
        done = first_pass(target, row, whole, window, captured_layers(target, sel.config.layers))
        firsts[key] = (row, done, _now(target) - t)
    row, done, seconds = firsts[key]
    return row, done, {"pass1": seconds}


@torch.inference_mode()
def handoff_variants(source: Runner, target: Runner, mappers: dict[str, Mapper], ids: list[int],
                     variants: list[tuple[str, HandoffConfig]], source_cache: KVCache,
                     source_attn: torch.Tensor | None = None,
                     target_prefill: tuple[KVCache, torch.Tensor] | None = None,
                     ) -> tuple[KVCache, torch.Tensor, list[HandoffResult]]:
    """One prompt handed off under several (map label, config) variants at once, as an evaluation
    comparing selectors and budgets does. Equal to one `handoff` per variant (tested), cheaper:
    each map runs once and its output is shared; variants with the same budget recompute
    together as one batch (one pass over the target's weights instead of one per variant). A two-pass
    selector's first pass runs once per map and window, on a copy of the mapped cache; its second is a
    direct recompute of its set from the mapped cache (transfer/query.py), so it joins its budget's batch
    (a refining variant's from its own copy, which its refining pass wrote).

    `source_cache` (batch one) holds the source's own rows for the whole prompt; `source_attn`
    (1, n) is its captured attention (attn-source), `target_prefill` the target's own prefill
    cache and attention received (oracles).
    Returns a cache with one row per variant, their last logits (A, V) and their records.
    """
    n = len(ids)
    whole = torch.tensor([ids], device=target.device)  # (1, n)
    positions = torch.arange(n, device=target.device)[None]  # (1, n)
    fits = [(label, mappers[label].at_rho(cfg.rho)) for label, cfg in variants]  # per variant: (label, fit)
    mapped: dict[int, tuple[KVCache, dict[str, torch.Tensor], float]] = {}  # per fit (id), run once
    for _, mapper in fits:
        if id(mapper) in mapped:
            continue
        t = _now(target)
        cache = target.new_cache(1, n)
        centred = mapper.apply(source, source_cache, target, cache, positions, tokens=whole)
        mapped[id(mapper)] = (cache, centred, _now(target) - t)

    out = target.new_cache(len(variants), n)
    logits = torch.empty(len(variants), target.config.vocab_size, device=target.device)
    results: list[HandoffResult | None] = [None] * len(variants)
    groups: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None, float, dict, KVCache]]] = {}
    firsts: dict[tuple, tuple] = {}  # two-pass selectors: pass 1 per (fit, window, layers), run once
    for v, (label, cfg) in enumerate(variants):
        cache, centred, map_s = mapped[id(fits[v][1])]
        if cfg.schedule == LAYER_PREFIX:  # not a position set
            row = out.row(v)
            row.copy_prefix(cache, n)
            _, lg, res = _layer_prefix(target, [ids], cfg, row, whole, positions, [0], {"map": map_s})
            logits[v], results[v] = lg[0], res
            continue
        t = _now(target)
        ctx = SelectionContext(source, target, fits[v][1], whole, positions, cache, centred, source_attn,
                               cfg.seed, target_prefill)
        sel, extra, base = cfg.scorer, {}, cache
        if sel.two_pass:  # pass 2 is a direct recompute of its set from the mapped cache: it joins the batch
            row, done, extra = _first_pass_of(target, firsts, id(fits[v][1]), cache, whole, positions, sel, cfg.rho)
            if sel.config.refine:  # its refining pass writes a copy of the mapped cache: the last pass starts there
                base = target.new_cache(1, n)  # (a handoff refines in place: the copy is not timed)
                base.copy_prefix(cache, n)
            t = _now(target)
            p = choose(target, row, whole, positions, [n], sel, cfg.rho, ctx.rank_scores() if sel.needs_rank
                       else None, done, refined=base,
                       source=read_at(source_attn, positions) if sel.needs_source_attention else None)
            done_positions, first = p.recomputed(0)
            chosen, scores = p.chosen[0], p.scores[0]
            extra = {**extra, "first": first, "recomputed": done_positions, "refine": p.timings.get("refine", 0.0)}
        else:
            scores = sel.scores(ctx)[0]  # (n,)
            chosen = select_top(scores, budget(cfg.rho, n))
        score_s = _now(target) - t - extra.get("refine", 0.0)
        groups.setdefault(len(chosen), []).append((v, chosen, scores.cpu(), score_s, extra, base))

    for k, group in groups.items():  # one recompute per budget
        t = _now(target)
        batch = target.new_cache(len(group), n)
        for g, (*_, base) in enumerate(group):
            batch.row(g).copy_prefix(base, n)
        pos = torch.stack([c for _, c, *_ in group])  # (G, k)
        lg = target.forward(whole[0][pos], pos, batch).logits  # (G, V)
        recompute_s = _now(target) - t
        for g, (v, chosen, scores, score_s, extra, _) in enumerate(group):
            out.row(v).copy_prefix(batch.row(g), n)
            logits[v] = lg[g]
            timings = {"map": mapped[id(fits[v][1])][2], "score": score_s, "recompute": recompute_s,
                       "recompute_batch": len(group)}
            first, positions_done = None, chosen.tolist()
            if "first" in extra:  # every pass: pass 1 (shared by the variants with its window), a refining
                # pass (its own), the last pass (the budget's batch)
                earlier = timed_passes(variants[v][1].scorer)[:-1]
                passes = {**{k: extra[k] for k in earlier}, "pass2": recompute_s}
                timings.update(passes, recompute=sum(passes.values()))
                first, positions_done = [extra["first"]], extra["recomputed"]
            results[v] = HandoffResult([positions_done], [scores], [(0, n)], timings=timings, first_pass=first)
    return out, logits, results
