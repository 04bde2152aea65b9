"""Which positions the target recomputes: rank disagreement and the baselines, one interface.

A selector scores every handed-off position (higher = recompute first); the
handoff takes the top ⌈ρ·T⌉ with the last position forced in. Oracles look at the
target's own prefill, which a deployment never has: they are marked `oracle` and
labelled so wherever results are printed, and are never a default.
`layer-prefix` (DroidSpeak-style) chooses no positions, so it is not here: it is a
schedule of the handoff (`transfer/handoff.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..engine.cache import KVCache
from ..engine.runner import AttnCapture, ForwardOutput, Runner
from .. import registry
from ..errors import RarecacheError
from ..models.tokenizer import BLANK, LEADING_BREAK, LINE, TRAILING_BREAK
from .choice import in_turn, lexicographic, order_rank, pieces, segments, spans, union_of_groups
from .mapper import Mapper, rank_scores  # (rank disagreement: the map's own score)

ATTN_QUERIES = 32  # last queries whose attention is summed (the RaReCache paper, arXiv 2610.11358, §4.3)


@dataclass
class SelectionContext:
    """What a selector may look at for one batch. Positions are (B, W), -1 padded."""

    source: Runner
    target: Runner
    mapper: Mapper
    tokens: torch.Tensor  # (B, n) whole prompts
    positions: torch.Tensor  # (B, W) the handed-off positions
    mapped: KVCache  # target cache after the map, before any recompute
    centred: dict[str, torch.Tensor] | None  # the map's centred outputs z per side, (Lt, B, W, dt), if kept
    source_attn: torch.Tensor | None = None  # (B, S) attention received in the source, if captured
    seed: int = 0
    _target_prefill: tuple[KVCache, torch.Tensor] | None = field(default=None, repr=False)
    rank: torch.Tensor | None = None  # (B, W) rank disagreement, when the map computed it (Mapper.apply_scored)

    def rank_scores(self) -> torch.Tensor:
        """Rank disagreement per position (B, W): the map's, or computed from the centred outputs."""
        if self.rank is not None:
            return self.rank
        if self.centred is None:
            raise ValueError("rank disagreement needs the map's score or its centred outputs")
        return rank_scores(self.mapper, self.centred)

    def target_prefill(self) -> tuple[KVCache, torch.Tensor]:
        """The target's own prefill (oracles only): its cache and attention received (B, S),
        run here unless the handoff was given one."""
        if self._target_prefill is None:
            n = self.tokens.shape[1]
            pos = torch.arange(n, device=self.tokens.device).expand_as(self.tokens)
            last = self.positions.max(1).values  # each row's last handed-off position
            pos = torch.where(pos <= last[:, None], pos, -1)
            cache = self.target.new_cache(self.tokens.shape[0], n)
            _, attn = forward_received(self.target, self.tokens, pos, cache, last + 1, n, logits_at=None)
            self._target_prefill = (cache, attn)
        return self._target_prefill


def attention_capture(runner: Runner, ends: torch.Tensor) -> AttnCapture:
    """Capture the last ATTN_QUERIES queries (rows ending at `ends`, exclusive) in the last quarter of layers."""
    L = runner.num_layers
    layers = frozenset(range(L - max(1, L // 4), L))
    offsets = torch.arange(-ATTN_QUERIES, 0, device=ends.device)
    rows = (ends[:, None] + offsets).clamp(min=0)  # (B, R); short rows repeat their first query
    return AttnCapture(layers, rows)


def forward_received(runner: Runner, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     ends: torch.Tensor, width: int, logits_at: str | torch.Tensor | None = "last"
                     ) -> tuple[ForwardOutput, torch.Tensor]:
    """One forward that also returns the attention its last queries (rows ending at `ends`) give each key slot
    (B, width): what attn-source and the oracles score by. The one place a prefill reads it."""
    out = runner.forward(tokens, positions, cache, logits_at=logits_at, capture=attention_capture(runner, ends))
    return out, received(out.attn, width)


def received(attn: dict[int, torch.Tensor], width: int) -> torch.Tensor:
    """Attention each key slot receives, summed over captured layers, heads and queries -> (B, width)."""
    total = sum(p.sum(dim=(1, 2)) for p in attn.values())  # (B, S)
    out = torch.zeros(total.shape[0], width, device=total.device)
    out[:, : min(width, total.shape[1])] = total[:, :width]
    return out


def read_at(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values (B, S) read at positions (B, W) (padding reads 0)."""
    return values.gather(1, positions.clamp(min=0)) * (positions >= 0)


class Selector:
    """A subclass's `name` is the one registry.py's SELECTORS gives it, and it is an `oracle` when registered
    among the oracles (`__init_subclass__`): each name is written once, there. A class registered under
    several names (`QuerySelector`) gives them to its instances; one registered under none (a test's own)
    keeps what it says."""

    name = ""
    oracle = False
    two_pass = False  # scores come from a first recompute pass (transfer/query.py), not from one score
    needs_source_attention = False
    needs_rank = False  # reads rank disagreement: the handoff has the map compute it on the way

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = registry.SELECTORS.names_of(cls.__module__, cls.__qualname__)
        if len(names) == 1:
            cls.name, cls.oracle = names[0], names[0] in registry.SELECTORS.oracles

    def scores(self, ctx: SelectionContext) -> torch.Tensor:  # (B, W)
        raise NotImplementedError

    @property
    def label(self) -> str:
        return f"{self.name} (oracle)" if self.oracle else self.name


class RankDisagreement(Selector):
    needs_rank = True

    def scores(self, ctx):
        return ctx.rank_scores()


class Random(Selector):
    def scores(self, ctx):
        g = torch.Generator().manual_seed(ctx.seed)
        return torch.rand(ctx.positions.shape, generator=g).to(ctx.positions.device)


class SourceAttention(Selector):
    needs_source_attention = True

    def scores(self, ctx):
        return read_at(ctx.source_attn, ctx.positions)


class Suffix(Selector):
    """The newest ⌈ρ·T⌉ positions: the one shape an engine's prefix cache recomputes natively
    (vLLM computes every position after the tokens a connector claims)."""

    def scores(self, ctx):
        return ctx.positions.float()  # later positions first; padding (-1) last


def _row_share(x: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) over each row's total, so signals on different scales can be combined."""
    x = x.float().clamp(min=0)
    return x / x.sum(1, keepdim=True).clamp(min=1e-30)


class AttentionTimesRank(Selector):
    """Attention the source gives a position times its rank disagreement: an attention-weighted
    estimate of the mapping error the target will read. Rank disagreement says where the map is
    likely wrong; attention says whether that error is looked at."""

    needs_source_attention = True
    needs_rank = True

    def scores(self, ctx):
        return _row_share(read_at(ctx.source_attn, ctx.positions)) * _row_share(ctx.rank_scores())


class AttentionPlusRank(Selector):
    """The mean of the two shares: a position high on either signal is recomputed."""

    needs_source_attention = True
    needs_rank = True

    def scores(self, ctx):
        return _row_share(read_at(ctx.source_attn, ctx.positions)) + _row_share(ctx.rank_scores())


class SuffixPlusAttention(Selector):
    """The newest positions and the ones the source attends to most, taken in turn: any budget's
    top set holds about half of each (a position on both lists counts once). The newest
    positions are what the mapped cache gets most wrong for the next token (on 0-shot MMLU the
    suffix alone keeps the target's accuracy); the attended ones (sinks, delimiters, the
    exemplars' answers) are what every later position reads. One ordering for every budget,
    so the gate's nested rungs apply."""

    needs_source_attention = True

    def scores(self, ctx):
        return _newest_in_turn_with(ctx.positions, read_at(ctx.source_attn, ctx.positions))


def _newest_in_turn_with(positions: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Scores (B, W) that take the newest positions and the highest of `other` (B, W) in turn,
    newest first (a position on both lists counts once, at its earlier turn); padding last."""
    return in_turn(positions.float(), other, positions < 0)


class SuffixPlusRank(Selector):
    """The newest positions and the ones rank disagreement flags, taken in turn (as suffix+attn):
    the suffix keeps what the next token reads most, rank disagreement the rows the map is least
    sure of, which passage questions read the answer from (issue 41: suffix alone falls below
    random there). Deployable, one ordering for every budget."""

    needs_rank = True

    def scores(self, ctx):
        return _newest_in_turn_with(ctx.positions, ctx.rank_scores())


class TargetAttention(Selector):
    """The attention the target's own prefill gives a position (an oracle: registry.py lists it so)."""

    def scores(self, ctx):
        return read_at(ctx.target_prefill()[1], ctx.positions)


class L2Oracle(Selector):
    """Relative ℓ2 error of mapped vs true K and V, averaged over layers (CacheBlend-style)."""

    def scores(self, ctx):
        true_cache, _ = ctx.target_prefill()
        slots = ctx.mapped.slots(ctx.positions)  # (B, W)
        err = 0
        for mapped, true in ((ctx.mapped.k, true_cache.k), (ctx.mapped.v, true_cache.v)):
            L, B, H, _, D = true.shape
            idx = slots[None, :, None, :, None].expand(L, B, H, slots.shape[1], D)
            m = mapped.gather(3, idx).float().transpose(2, 3).flatten(3)  # (L, B, W, H·D)
            t = true.gather(3, idx).float().transpose(2, 3).flatten(3)
            err = err + ((m - t).norm(dim=-1) / t.norm(dim=-1).clamp(min=1e-6)).mean(0)
        return err / 2


GROUPS = ("sum", "layer", "head")  # QueryConfig.group
SEGMENTS = ("", "line", "block")  # QueryConfig.segment


def text_ends(runner: Runner, tokens: torch.Tensor, kind: str) -> torch.Tensor:
    """(B, n) bool: the positions of whole prompts `tokens` (B, n) whose token ends a line (`line`) or a
    paragraph (`block`: a blank line, in one token or across two), read from the runner's `break_flags`."""
    if kind not in SEGMENTS[1:]:
        raise ValueError(f"segments end at a line or a block, not {kind!r}")
    if runner.break_flags is None:
        raise RarecacheError("this selector recomputes whole lines, read from the tokenizer: load the model with "
                             "its tokenizer (Runner.learn_lines)")
    f = runner.break_flags[tokens.to(runner.break_flags.device)].long()  # (B, n)
    if kind == "line":
        return (f & LINE) != 0
    # (B, n): the token before ends on a line break with only blanks after it
    trailing_before = F.pad((f[:, :-1] & TRAILING_BREAK) != 0, (1, 0), value=False)
    return ((f & BLANK) != 0) | (trailing_before & ((f & LEADING_BREAK) != 0))


@dataclass(frozen=True)
class QueryConfig:
    """How a query-aware selector ranks the handed-off positions (the passes run in transfer/query.py).

    Pass 1 recomputes the newest `window` positions (the question and the answer header) over the
    mapped cache and reads the target's attention from them; pass 2 recomputes the newest again and the
    positions they attend to most. Both count in the budget (`split`). With `refine`, a pass between them
    recomputes the window and the top share of the picks, the window's attention is read again over those
    rows (nearer the target's own reading than over mapped rows alone), and the last pass recomputes the
    window and the rest of the picks from it; the refining pass's picks keep its rows (`refined`)."""

    window: int = 32  # pass 1: the newest positions ...
    window_share: float = 0.25  # ... at most this share of the budget
    layers: float = 0.25  # the layers whose attention is read: this top share of the stack (as attention_capture)
    group: str = "sum"  # sum: one score over layers, heads, queries; layer / head: each one's top positions in turn
    value: bool = False  # weigh each attention weight by the norm of the (mapped) value row it reads
    common: bool = False  # subtract the attention every window query gives a position (sinks, template, delimiters)
    sinks: int = 4  # the prompt's first positions are left out of the attention ranking (0: none)
    span: int = 0  # each pick brings this many neighbours on either side (a fact is a line, not a token)
    segment: str = ""  # or each pick brings its whole line / block (paragraph) ... (one-pass `source` only)
    piece: int = 0  # ... cut into pieces of at most this many positions; with `span` too: both orders in turn
    rank: bool = False  # take rank disagreement's picks in turn with attention's
    source: bool = False  # one pass: the source's attention from its last queries (attn-source's), no pass 1
    refine: float = 0.0  # a refining pass recomputes this share of the picks and the window, then reads again
    blend: bool = False  # two passes: the target's attention and the source's (attn-source's), each a share, summed

    def __post_init__(self):
        shares = 0 < self.layers <= 1 and 0 <= self.window_share <= 1 and min(self.window, self.sinks, self.span) >= 0
        shares &= 0 <= self.refine < 1 and not (self.refine and self.source)
        shares &= not self.blend or (not (self.source or self.refine) and self.group == "sum")
        segment = self.segment in SEGMENTS and bool(self.segment) == (self.piece > 0) and (
            not self.segment or self.source)
        if self.group not in GROUPS or not shares or not segment:
            raise RarecacheError(f"bad query selector settings {self}")

    def split(self, total: int, handed: int) -> int:
        """Pass 1's positions for a budget of `total` over `handed` positions, where pass 1 (w) + pass 2
        (the same w again and total - 2w others) = total; 0: one pass (the whole span when the budget
        covers it, so ρ 1 is the target's own prefill; the newest `total` when two passes do not fit)."""
        if self.source or total >= handed:
            return 0
        return max(0, min(self.window, int(self.window_share * total), (total - 1) // 2))

    def refined(self, total: int, window: int) -> int:
        """The picks a refining pass recomputes for a budget of `total` with pass 1's `window` (0: none), where
        pass 1 (w) + the refining pass (w + m) + the last pass (w + the rest) = total."""
        if not (self.refine and window):
            return 0
        return int(self.refine * max(0, total - 3 * window))


class QuerySelector(Selector):
    """Positions the question reads: the target's own attention from the newest positions, recomputed
    first over the mapped cache (two passes, transfer/query.py), or the source's (`source`, one pass).
    Sinks and the prompt's first positions draw attention from every query without carrying content:
    they are left out of the ranking (`sinks`) or what every query gives is taken off (`common`)."""

    def __init__(self, name: str, config: QueryConfig):
        self.name, self.config = name, config
        self.two_pass = not config.source
        self.needs_source_attention = config.source or config.blend
        self.needs_rank = config.rank

    def ends(self, runner: Runner, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """(B, W) bool: which handed-off positions end a segment (`segment` variants), else None."""
        if not self.config.segment:
            return None
        ends = text_ends(runner, tokens, self.config.segment).to(positions.device)  # (B, n)
        return ends.gather(1, positions.clamp(min=0)) & (positions >= 0)

    def order(self, att: torch.Tensor, positions: torch.Tensor, forced: torch.Tensor | None = None,
              rank: torch.Tensor | None = None, ends: torch.Tensor | None = None,
              source: torch.Tensor | None = None) -> torch.Tensor:
        """Scores (B, W), one order for every budget, from attention received att (B, G, W) per group (one
        group, a layer's or a (layer, head)'s) at positions (B, W): the `forced` ones first (pass 1's), then the
        ranked ones, then the sinks, padding last. `ends` (B, W): where segments end (`segment` variants);
        `source` (B, W): the source's attention at the positions (`blend` variants)."""
        cfg, pad = self.config, positions < 0
        eligible = ~pad & (positions >= cfg.sinks)
        if forced is not None:
            eligible &= ~forced
        if cfg.blend:  # each signal as a share of what the ranked positions receive, summed
            if source is None:
                raise ValueError(f"{self.name} blends in the source's attention: pass it")
            att = (_row_share(att[:, 0] * eligible) + _row_share(source * eligible))[:, None]
        key = union_of_groups(att, eligible) if att.shape[1] > 1 else att[:, 0].float()
        if cfg.segment:
            if ends is None:
                raise ValueError(f"{self.name} orders by segments: pass where they end")
            whole = segments(key, pieces(ends, cfg.piece), eligible)
            key = in_turn(spans(key, cfg.span, eligible), whole, ~eligible) if cfg.span else whole
        else:
            key = spans(key, cfg.span, eligible)
        if cfg.rank:
            key = in_turn(key, rank, ~eligible)
        tier = eligible.float() - 2 * pad.float() + (2 * forced.float() if forced is not None else 0)
        return lexicographic(tier, key.masked_fill(~eligible, float("-inf")))

    def scores(self, ctx):
        if self.two_pass:
            raise RuntimeError(f"{self.name} runs in two passes (transfer/query.py), not from one score")
        att = read_at(ctx.source_attn, ctx.positions)[:, None]  # (B, 1, W)
        return self.order(att, ctx.positions, rank=ctx.rank_scores() if self.config.rank else None,
                          ends=self.ends(ctx.target, ctx.tokens, ctx.positions))


SPAN = 8  # neighbours on either side in the span variants
LINE_PIECE, BLOCK_PIECE = 64, 128  # the longest piece of a line / of a block the segment variants take at once
QUERY_VARIANTS = {  # registry name -> settings: each screened by name (`0.3:query-span@MAP`)
    registry.QUERY: QueryConfig(),
    registry.QUERY_LAYER: QueryConfig(group="layer"),
    registry.QUERY_HEAD: QueryConfig(group="head"),
    registry.QUERY_ALL: QueryConfig(layers=1.0),
    registry.QUERY_VALUE: QueryConfig(value=True),
    registry.QUERY_COMMON: QueryConfig(common=True),
    registry.QUERY_RAW: QueryConfig(sinks=0),
    registry.QUERY_SPAN: QueryConfig(span=SPAN),
    registry.QUERY_LAYER_SPAN: QueryConfig(group="layer", span=SPAN),
    registry.QUERY_RANK: QueryConfig(rank=True),
    registry.QUERY_W8: QueryConfig(window=8),
    registry.QUERY_W64: QueryConfig(window=64),
    registry.ATTN_SOURCE_SPAN: QueryConfig(source=True, span=SPAN),
    registry.ATTN_SOURCE_LINE: QueryConfig(source=True, segment="line", piece=LINE_PIECE),
    registry.ATTN_SOURCE_BLOCK: QueryConfig(source=True, segment="block", piece=BLOCK_PIECE),
    registry.ATTN_SOURCE_MIX: QueryConfig(source=True, span=SPAN, segment="block", piece=BLOCK_PIECE),
    registry.QUERY_REFINE: QueryConfig(window=8, refine=0.5),
    registry.ATTN_SOURCE_SPAN_RAW: QueryConfig(source=True, span=SPAN, sinks=0),  # the sinks ranked, with spans
    registry.QUERY_BLEND: QueryConfig(window=8, blend=True, span=SPAN),
}


SELECTORS: dict[str, Selector] = {s.name: s for s in (RankDisagreement(), Random(), SourceAttention(), Suffix(),
                                                       AttentionTimesRank(), AttentionPlusRank(), SuffixPlusAttention(),
                                                       SuffixPlusRank(),
                                                       TargetAttention(),
                                                       L2Oracle(),
                                                       *(QuerySelector(n, c) for n, c in QUERY_VARIANTS.items()))}
