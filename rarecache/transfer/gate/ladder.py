"""The gate's ladder for one prompt: map once, then climb rungs that are each a direct handoff at their
ρ, accept one or fall back to the target's own prefill (the policy and why the rungs rerun: policy.py).

Serving runs each rung as one `Runner.forward` over the positions it reruns (`rung_run`). An evaluation
(`climb_all`) climbs every rung and measures the candidate signals on the way (`Rung`: nll, nll_shift,
nll_gap, probe_cos, row_error per layer), each with its cost; a served policy on `nll` measures that one
alone. The rung's pass then runs layer by layer
through the runner's own pieces (the same operations `Runner.layer` runs; tested equal to the serving
pass), so the probe queries and the hidden states the nll reads come from the rung's own pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...engine.cache import KVCache
from ...engine.runner import Runner, Step, spans
from ...errors import RarecacheError
from ..handoff import HandoffConfig, HandoffResult, _now, budget, map_and_score, select_top, subset
from ..mapper import Mapper
from .policy import ALWAYS_FALLS_BACK, GatePolicy, GateResult, Rung, _accepts, accept_reason, fallback_reason, js_bits

PROBES = 4  # probe queries per rung: the newest positions it runs (the last among them)
CHUNK = 256  # positions per LM-head product when reading surprisals


def rung_run(before: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The positions a rung reruns so its cache is a direct handoff's: every chosen position from the first
    one the rung adds (those after it attended to rows that were mapped below and are recomputed now).
    `before`, `chosen`: ascending positions of the rung below and of this rung (a superset, with the
    last position). Rows chosen before the first added one saw the same context below: kept as they are."""
    added = chosen[~torch.isin(chosen, before)]
    start = int(added.min()) if len(added) else int(chosen[-1])  # nothing added: the last position only
    return chosen[chosen >= start]


def _confidence(logits: torch.Tensor) -> tuple[float, float]:
    """Top-2 log-probability margin (nats) and entropy (bits) of the next-token distribution."""
    lp = F.log_softmax(logits.double(), -1)
    top = lp.topk(2).values
    return (top[0] - top[1]).item(), -(lp.exp() * lp).sum().item() / math.log(2)


def _outside(scores: torch.Tensor, chosen: torch.Tensor) -> float:
    """Share of the (shifted non-negative) score mass on positions not chosen."""
    s = scores.double()
    s = s - s.min()
    total = s.sum().item()
    return 0.0 if total <= 0 else 1.0 - s[chosen].sum().item() / total


def _surprisal(runner: Runner, h: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, nxt: torch.Tensor
               ) -> torch.Tensor:
    """Bits of the next tokens `nxt` (K,) under the runner's LM head at rows `rows` (K,) of h (1, T, C)."""
    out = []
    for a in range(0, len(rows), CHUNK):
        lg = runner.logits(h, pos, rows[None, a:a + CHUNK])[0].double()  # (k, V)
        out.append(lg.logsumexp(-1) - lg.gather(-1, nxt[a:a + CHUNK, None].to(lg.device))[:, 0])
    return torch.cat(out).cpu() / math.log(2) if out else torch.zeros(0, dtype=torch.float64)


class _Measure:
    """The signals an evaluation records per rung (module docstring), and what each costs; `light`: only
    `nll`, what a served policy on that signal reads (no probes, no source pass, no row error)."""

    def __init__(self, source: Runner, target: Runner, source_cache: KVCache, cache: KVCache, whole: torch.Tensor,
                 n: int, light: bool = False):
        self.source, self.target, self.source_cache, self.whole, self.n = source, target, source_cache, whole, n
        self.light = light
        self.mapped = None if light else target.new_cache(1, n)  # the cache as the map left it: what the probes
        if self.mapped is not None:  # and row_error read
            self.mapped.copy_prefix(cache, n)
        self.own: dict[int, float] = {}  # the source's surprisal per position
        self.source_s = 0.0
        self.below: dict[int, float] = {}  # the rung below's surprisal per position it recomputed

    def source_surprisal(self, positions: list[int]) -> list[float]:
        """The source's own surprisal at `positions` (its rows are exact: a pass over them on a copy of its
        cache gives its own hidden states), computed once per position."""
        missing = torch.tensor([p for p in positions if p not in self.own], dtype=torch.long)
        if len(missing):
            t = _now(self.source)
            copy = self.source.new_cache(1, self.n)
            copy.copy_prefix(self.source_cache, self.n)
            tok, pos = subset(self.whole.to(self.source.device), [missing.to(self.source.device)])
            step = Step.of(pos)
            copy.mark(pos, step.top)
            h, cos_sin = self.source.embed(tok), self.source.cos_sin(pos)
            for i in range(self.source.num_layers):
                h, _ = self.source.layer(i, h, pos, copy, cos_sin, step=step)
            bits = _surprisal(self.source, h, pos, torch.arange(len(missing), device=h.device),
                              self.whole[0, missing.to(self.whole.device) + 1])
            self.own.update(zip(missing.tolist(), bits.tolist()))
            self.source_s += _now(self.source) - t
        return [self.own[p] for p in positions]

    def rung(self, run: torch.Tensor, chosen: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, float, dict]:
        """Run `run` (ascending positions) through the target layer by layer over `cache` (as
        `Runner.forward` does), measuring on the way. Returns the last position's logits (V,), the pass's
        seconds without the measuring, and the signals with their costs."""
        target, n = self.target, self.n
        t0 = _now(target)
        tok, pos = subset(self.whole, [run])  # (1, m)
        step = Step.of(pos)
        cache.mark(pos, step.top)
        h, cos_sin = target.embed(tok), target.cos_sin(pos)
        probe = slice(max(0, pos.shape[1] - PROBES), pos.shape[1])
        ppos = pos[:, probe]
        pstep = Step.of(ppos)
        cos, probe_s = [], 0.0
        for i in range(target.num_layers):
            q, k, v = target.qkv(i, h, cos_sin)  # q (1, H, m, D)
            cache.write(i, pos, k, v, step.top)
            out, _ = target.attend(i, q, pos, cache, None, step)  # (1, H, m, D)
            if self.light:
                h = target.finish(i, h, out)
                continue
            t = _now(target)
            ref, _ = target.attend(i, q[:, :, probe], ppos, self.mapped, None, pstep)
            cos.append(F.cosine_similarity(out[:, :, probe].float(), ref.float(), dim=-1).mean().item())
            probe_s += _now(target) - t
            h = target.finish(i, h, out)
        logits = target.logits(h, pos, "last")[0]
        seconds = _now(target) - t0 - probe_s

        t = _now(target)  # the target's surprisal at the positions run (the others keep the rung below's values)
        inner = (pos[0] < n - 1).nonzero()[:, 0]  # rows with a next token in the prompt
        bits = _surprisal(target, h, pos, inner, self.whole[0, pos[0, inner] + 1])
        mine = dict(self.below)
        mine.update(zip(pos[0, inner].tolist(), bits.tolist()))
        scored = [p for p in chosen.tolist() if p < n - 1]
        mine = {p: mine[p] for p in scored}
        nll = sum(mine.values()) / len(scored) if scored else 0.0
        nll_s = _now(target) - t
        if self.light:
            self.below = mine
            return logits, seconds, {"nll": nll, "signal_seconds": {"nll": nll_s}}
        src_before = self.source_s
        own = self.source_surprisal(scored)
        t = _now(target)
        nll_shift = nll - (sum(own) / len(scored) if scored else 0.0)
        gap = [abs(mine[p] - self.below.get(p, o)) for p, o in zip(scored, own)]
        self.below = mine
        nll_s += _now(target) - t

        t = _now(target)  # row error per layer at the rung's positions, against the mapped rows
        err, ref = torch.zeros(target.num_layers, dtype=torch.float64), torch.zeros(target.num_layers,
                                                                                    dtype=torch.float64)
        for now_, then in ((cache.k, self.mapped.k), (cache.v, self.mapped.v)):
            exact = now_[:, 0, :, chosen].double()  # (L, Hkv, K, D)
            err += (exact - then[:, 0, :, chosen].double()).pow(2).sum((1, 2, 3)).cpu()
            ref += exact.pow(2).sum((1, 2, 3)).cpu()
        row_s = _now(target) - t
        signals = {"nll": nll, "nll_shift": nll_shift, "nll_gap": sum(gap) / len(gap) if gap else 0.0,
                   "probe_cos": sum(cos) / len(cos), "row_error": (err.sum() / ref.sum().clamp(min=1e-300)).item(),
                   "row_error_layers": (err / ref.clamp(min=1e-300)).tolist(),
                   "signal_seconds": {"nll": nll_s, "source_nll": self.source_s - src_before, "probe": probe_s,
                                      "row_error": row_s}}
        return logits, seconds, signals


@torch.inference_mode()
def gated_handoff(source: Runner, target: Runner, mapper: Mapper, ids: list[int], policy: GatePolicy,
                  source_cache: KVCache | None = None, source_kept: int = 0, target_cache: KVCache | None = None,
                  target_kept: int = 0, source_attn: torch.Tensor | None = None, climb_all: bool = False,
                  snapshots: KVCache | None = None, view_snapshots: KVCache | None = None
                  ) -> tuple[KVCache, torch.Tensor, GateResult]:
    """Hand one prompt from source to target through the ladder of `policy`.

    Arguments as `handoff` for a batch of one. Returns the target cache, its logits at the last
    position (1, V) and the record. `climb_all` (evaluation) climbs every rung from the first whatever
    the policy decides, never falls back and measures every signal; `snapshots`, a cache with one row
    per rung, then receives each rung's cache, and the logits returned are per rung (R, V);
    `view_snapshots` (a map with two views) receives each rung's cache with the rows still mapped from
    the other view, whose last-position logits the record's `views_logits` holds.
    """
    n = len(ids)

    def own_prefill(cache: KVCache, timings: dict) -> torch.Tensor:  # the fallback: every handed-off row rewritten
        t = _now(target)
        toks, pos = spans([ids], [target_kept], target.device)
        logits = target.forward(toks, pos, cache).logits
        timings["fallback_prefill"] = _now(target) - t
        return logits

    if policy.always_falls_back and not climb_all:  # decided already: no map, no source prefill, no rung
        cache = target_cache or target.new_cache(1, n)
        result = HandoffResult([list(range(target_kept, n))], None, [(target_kept, n)])
        logits = own_prefill(cache, result.timings)
        return cache, logits, GateResult("fallback", 1.0, ALWAYS_FALLS_BACK, [], result, 1.0, source_prefilled=False)
    if policy.signal == "js_views" and not mapper.has_plain_view:
        raise RarecacheError("the gate policy's signal js_views compares the map's two views, and this map has "
                             "one (no plain-transfer sharpening recorded): serve a map made by `calibrate --preset "
                             "general` or `refit --plain-sharpen`, or a policy fitted on js")
    cfg = HandoffConfig(policy.rungs[0], policy.selector)
    source_cache = source_cache if source_cache is not None else source.new_cache(1, n)
    m = map_and_score(source, target, mapper, [ids], cfg, None, source_cache, [source_kept], target_cache,
                      [target_kept], source_attn)
    cache, whole, timings = m.cache, m.whole, m.timings
    views = None  # the cache with the rows still mapped from the map's other view: a second opinion on them
    if mapper.has_plain_view and (climb_all or policy.signal == "js_views"):
        t = _now(target)
        views = target.new_cache(1, cache.max_len)
        views.copy_prefix(cache, n)  # (rows the target held before the handoff, too)
        mapper.plain().apply_scored(source, source_cache, target, views, m.positions, rank=False, tokens=m.tokens)
        views_map_s = _now(target) - t
    w = n - target_kept
    scores = m.scores[0, :w]  # (W,)
    measure = _Measure(source, target, source_cache, cache, whole, n, light=not climb_all) if (
        climb_all or policy.signal == "nll") else None
    last = torch.tensor([n - 1], device=whole.device)
    other_logits: list[torch.Tensor] = []  # the other view's last-position logits, rung 0 first

    def climb(before: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, float, dict, float, float, int]:
        run = rung_run(before, chosen)
        if measure is not None:
            lg, secs, signals = measure.rung(run, chosen, cache)
        else:
            t = _now(target)
            lg, signals = target.forward(*subset(whole, [run]), cache).logits[0], {}
            secs = _now(target) - t
        if views is None:
            return lg, secs, signals, 0.0, 0.0, len(run)
        t = _now(target)  # the same rung with the rows still mapped from the other view: the last position again
        for mine, other in ((cache.k, views.k), (cache.v, views.v)):
            other[:, 0, :, chosen] = mine[:, 0, :, chosen]  # (L, Hkv, K, D): the rung's recomputed rows
        other_lg = target.forward(*subset(whole, [last]), views).logits[0]
        other_logits.append(other_lg)
        return lg, secs, signals, js_bits(lg, other_lg), _now(target) - t, len(run)

    lg, secs, sig, views_js, views_s, ran = climb(last[:0], last)  # rung 0: plain transfer
    plain = prev = lg
    rungs = [Rung(0.0, 1, 0.0, True, _outside(scores, last - target_kept), secs, *_confidence(lg), 0.0,
                  js_views=views_js, views_seconds=views_s, run=ran, **sig)]
    f = 0 if climb_all else policy.first_rung
    ladder = range(f, len(policy.rungs) if climb_all else f + len(policy.climbed))
    before, per_rung, accepted = last, [], None
    for k in ladder:
        rho = policy.rungs[k]
        chosen = select_top(scores, budget(rho, w)) + target_kept  # ascending: a direct handoff's choice at rho
        lg, secs, sig, views_js, views_s, ran = climb(before, chosen)
        rung = Rung(rho, len(chosen), js_bits(lg, prev), bool(lg.argmax() == prev.argmax()),
                    _outside(scores, chosen - target_kept), secs, *_confidence(lg), js_bits(lg, plain),
                    js_views=views_js, views_seconds=views_s, run=ran, **sig)
        rungs.append(rung)
        before, prev = chosen, lg
        if snapshots is not None:
            snapshots.row(k).copy_prefix(cache, n)
        if view_snapshots is not None and views is not None:
            view_snapshots.row(k).copy_prefix(views, n)
        per_rung.append(lg)
        if accepted is None and _accepts(policy.threshold, policy.min_margin, rung.signal(policy.signal), rung.margin):
            accepted = len(rungs) - 1
            if not climb_all:
                break
    timings["recompute"] = sum(r.seconds for r in rungs)
    if measure is not None:
        timings["signals"] = sum(sum(r.signal_seconds.values()) for r in rungs)
    if views is not None:
        timings["views"] = views_map_s + sum(r.views_seconds for r in rungs)  # mapping the other view, last passes
    result = HandoffResult([before.tolist()], [scores.cpu()], [(target_kept, n)], timings=timings)
    if climb_all:
        return cache, torch.stack(per_rung), GateResult(
            "ladder", policy.rungs[-1], "climbed every rung", rungs, result, rungs[-1].recomputed / w,
            views_logits=torch.stack(other_logits[1:]) if views is not None else None)
    if accepted is not None:
        r, below = rungs[accepted], rungs[accepted - 1]
        why = accept_reason(policy, r.signal(policy.signal), r.margin,
                            f"rho={below.rho:g}" if below.rho else "plain transfer")
        return cache, prev[None], GateResult("accept", r.rho, why, rungs, result, r.recomputed / w)
    logits = own_prefill(cache, timings)
    last = rungs[-1]
    why = fallback_reason(policy, *((last.signal(policy.signal), last.margin) if len(rungs) > 1 else ()))
    result.positions = [list(range(target_kept, n))]
    return cache, logits, GateResult("fallback", 1.0, why, rungs, result, 1.0)
