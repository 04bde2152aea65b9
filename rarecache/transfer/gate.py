"""A handoff that never silently costs accuracy: climb a ladder of budgets until the answer stops
moving, or fall back to the target's own prefill.

A fixed ρ is too much for most prompts and too little for some (0-shot MMLU loses accuracy at
every selector at ρ = 0.3). The gate spends the budget in rungs (default ρ = 0.1, 0.2, 0.3, 0.5)
over one ordering of the positions by the selector's scores, so each rung is a superset of the
one below and recomputes only the positions it adds (plus the last, which yields the logits):
climbing to ρ costs about what a direct handoff at ρ does. Rung 0 is plain transfer (the last
position only) through the map's stored fit, not its plain-transfer view (`Mapper.plain`): it is
the cache every rung builds on by recomputing positions, which the stored fit serves better.
After each rung the target's next-token distribution at the last position is compared with the
rung below; their Jensen–Shannon divergence (bits) says whether the answer is
still moving. A map that records a plain-transfer sharpening holds two fits of the same statistics
(`Mapper.plain`); `signal="js_views"` compares instead the rung's distribution with the same rung's
when the rows still mapped come from the other fit: where the two views disagree, the answer hangs on
rows the map is unsure of (an ensemble's disagreement; it costs a second map and one more
last-position pass per rung). The policy accepts the first rung whose signal is at most its threshold;
above the top rung the target prefills the handed-off span itself (exact: every row is
rewritten), reusing the rows it held before the handoff.

The threshold is fitted on held-apart items (`fit_threshold`: the one that computes least while every
task stays within its loss bound), never on evaluated ones; policy files record what they were fitted
on. A policy may also stop climbing after `max_rungs` rungs and fall back there: where the answer
rarely settles (0-shot MMLU), climbing the whole ladder before a fallback costs more than the
target's own prefill, so the fit counts the rungs a fallback climbed as work and stops early. A
policy that can accept nothing (a negative threshold, or `max_rungs` 0) decides before the handoff:
the target prefills at once and nothing is mapped, so it costs exactly the target's own prefill.
Rung 1 of the ladder is exactly a direct handoff at its ρ (tested); higher rungs keep the rows
recomputed below them rather than recompute them against the better cache (the reuse that makes
climbing cheap), so they differ slightly from a direct handoff at the same ρ.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.cache import KVCache
from ..engine.runner import Runner, spans
from ..errors import RarecacheError
from .handoff import HandoffConfig, HandoffResult, _now, budget, map_and_score, subset
from .mapper import Mapper

RUNGS = (0.1, 0.2, 0.3, 0.5)
POLICY_FORMAT = "rarecache-gate-policy/1"
SIGNALS = ("js", "js_views")  # what a policy thresholds (GatePolicy.signal; module docstring)


@dataclass(frozen=True)
class GatePolicy:
    selector: str = "rank"
    rungs: tuple[float, ...] = RUNGS
    threshold: float = 0.0  # accept rung k when js(rung k, rung k-1) <= threshold (bits); < 0: always fall back
    min_margin: float | None = None  # and, if set, when its top-2 log-probability margin (nats) is at least this
    fitted: dict = field(default_factory=dict, compare=False, hash=False)  # what it was fitted on
    max_rungs: int | None = None  # climb at most this many rungs, then fall back (None: all; 0: at once, unmapped)
    signal: str = "js"  # SIGNALS: the rung-to-rung divergence, or the two views' (needs a map with a plain view)

    def __post_init__(self):
        rungs = tuple(self.rungs)
        if not rungs or any(not 0 < r < 1 for r in rungs) or any(b <= a for a, b in zip(rungs, rungs[1:])):
            raise RarecacheError(f"gate rungs must increase strictly inside (0, 1), got {list(rungs)}")
        for name, v in (("threshold", self.threshold), ("min_margin", self.min_margin)):
            if v is None and name == "min_margin":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise RarecacheError(f"gate {name} must be a number, got {v!r}")
        HandoffConfig(rungs[0], self.selector)  # validates the selector
        m = self.max_rungs
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= len(rungs)):
            raise RarecacheError(f"gate max_rungs must be a whole number from 0 to {len(rungs)} (or null), got {m!r}")
        if self.signal not in SIGNALS:
            raise RarecacheError(f"gate signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        object.__setattr__(self, "rungs", rungs)

    @property
    def always_falls_back(self) -> bool:
        """No rung can be accepted (a negative threshold: the divergence is never below it; or no rung
        climbed): such a policy decides before any handoff, so the target prefills at once and nothing
        is mapped (`gated_handoff`)."""
        return self.threshold < 0 or self.max_rungs == 0

    def at_loss(self, max_changed: float) -> "GatePolicy":
        """The policy the same fit gives at another loss bound: the stored level (`eval gate fit` fits
        several, `fitted.levels`) with the largest share of changed answers at most `max_changed` (its bpb
        bound scales with it). A clear error when the file stores none that low."""
        levels = self.fitted.get("levels")
        if not isinstance(levels, list) or not levels:
            raise RarecacheError("this gate policy stores no other loss levels (fit it again with `eval gate fit`)")
        def number(x) -> bool:
            try:
                return isinstance(x, (int, float)) and not isinstance(x, bool) and (math.isfinite(float(x)) or x < 0)
            except OverflowError:
                return False

        ok = []
        for lv in levels:
            if not (isinstance(lv, dict) and all(number(lv.get(k)) for k in ("max_changed", "max_bpb", "threshold"))
                    and all(math.isfinite(float(lv[k])) for k in ("max_changed", "max_bpb"))):
                raise RarecacheError("this gate policy's fitted.levels are malformed")
            if lv["max_changed"] <= max_changed + 1e-12:
                ok.append(lv)
        if not ok:
            have = ", ".join(f"{lv['max_changed']:g}" for lv in levels)
            raise RarecacheError(f"no fitted level allows at most {max_changed:g} changed answers (levels: {have})")
        lv = max(ok, key=lambda lv: (lv["max_changed"], lv["max_bpb"]))
        return GatePolicy(self.selector, self.rungs, lv["threshold"], lv.get("min_margin"),
                          {**self.fitted, "bounds": {"max_changed": lv["max_changed"], "max_bpb": lv["max_bpb"]},
                           "level": lv}, lv.get("max_rungs"), self.signal)

    def to_json(self) -> str:
        data = {"format": POLICY_FORMAT, **asdict(self), "rungs": list(self.rungs)}
        if self.signal == "js":  # left out: files (and the gate rules results record) stay as before
            del data["signal"]
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> GatePolicy:
        """A policy file (JSON, validated: it may come from anyone)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RarecacheError(f"{path}: not a readable gate policy ({e})") from None
        if not isinstance(data, dict) or data.get("format") != POLICY_FORMAT:
            raise RarecacheError(f"{path}: not a gate policy (format {POLICY_FORMAT} expected)")
        extra = set(data) - {"format", "selector", "rungs", "threshold", "min_margin", "fitted", "max_rungs", "signal"}
        if extra:
            raise RarecacheError(f"{path}: unknown gate policy field(s) {', '.join(sorted(extra))}")
        rungs, sel, fitted = data.get("rungs"), data.get("selector"), data.get("fitted", {})
        if (not isinstance(rungs, list) or not all(isinstance(r, (int, float)) for r in rungs)
                or not isinstance(sel, str) or not isinstance(fitted, dict)):
            raise RarecacheError(f"{path}: gate policy needs selector (text), rungs (numbers), fitted (object)")
        return cls(sel, tuple(float(r) for r in rungs), data.get("threshold"), data.get("min_margin"), fitted,
                   data.get("max_rungs"), data.get("signal", "js"))


def gate_rule(policy: GatePolicy) -> dict:
    """What decides a request under `policy` (selector, rungs, threshold, margin floor, max rungs) as
    its file writes it, without what it was fitted on: what results record it ran with."""
    return {k: v for k, v in json.loads(policy.to_json()).items() if k not in ("format", "fitted")}


def rungs_climbed(rungs: int, max_rungs: int | None) -> int:
    """How many of a ladder's `rungs` a policy climbs before it falls back."""
    return rungs if max_rungs is None else min(max_rungs, rungs)


@dataclass
class Rung:
    rho: float
    recomputed: int  # distinct handed-off positions the target has recomputed so far
    js: float  # bits, this rung's last-position distribution against the rung below
    top1_same: bool  # same most likely next token as the rung below
    outside: float  # share of the selector's score mass on positions not recomputed
    seconds: float  # this rung's recompute
    margin: float = 0.0  # nats between the most and second most likely next token
    entropy: float = 0.0  # bits, of the next-token distribution
    js_plain: float = 0.0  # bits, against plain transfer (rung 0)
    row_error: float = 0.0  # relative squared error of the mapped rows where recomputed so far (recorded ladders only)
    js_views: float = 0.0  # bits, this rung's last-position distribution against the same with the rows still
    # mapped taken from the map's other view (its plain-transfer fit); 0 where not measured
    views_seconds: float = 0.0  # that second last-position pass (and copying the rung's rows into it)

    def signal(self, name: str) -> float:
        """The value a policy with `signal` name thresholds."""
        return self.js if name == "js" else self.js_views


@dataclass
class GateResult:
    decision: str  # "accept" or "fallback"
    rho: float  # the accepted rung's ρ; 1.0 on fallback
    reason: str
    rungs: list[Rung]  # every rung climbed (rung 0, plain transfer, first)
    handoff: HandoffResult  # positions recomputed by the rungs, scores, phase timings
    recomputed_share: float  # of the handed-off span, 1.0 on fallback
    source_prefilled: bool = True  # the source read the prompt (False: a policy that decided before the handoff)
    views_logits: torch.Tensor | None = None  # (R, V): the other view's last-position logits per rung
    # (climb_all with view_snapshots only)

    def record(self) -> dict:
        """JSON-ready: what the response's `rarecache` object and result files show."""
        return {"decision": self.decision, "rho": self.rho, "reason": self.reason,
                "recomputed_share": self.recomputed_share, "source_prefilled": self.source_prefilled,
                "rungs": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(r).items()}
                          for r in self.rungs]}


def js_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    """Jensen–Shannon divergence in bits between the softmax distributions of logits a, b (V,)."""
    la, lb = F.log_softmax(a.double(), -1), F.log_softmax(b.double(), -1)
    m = torch.logaddexp(la, lb) - math.log(2)
    js = 0.5 * ((la.exp() * (la - m)).sum() + (lb.exp() * (lb - m)).sum())
    return max(0.0, js.item() / math.log(2))


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


@torch.inference_mode()
def gated_handoff(source: Runner, target: Runner, mapper: Mapper, ids: list[int], policy: GatePolicy,
                  source_cache: KVCache | None = None, source_kept: int = 0, target_cache: KVCache | None = None,
                  target_kept: int = 0, source_attn: torch.Tensor | None = None, climb_all: bool = False,
                  snapshots: KVCache | None = None, view_snapshots: KVCache | None = None
                  ) -> tuple[KVCache, torch.Tensor, GateResult]:
    """Hand one prompt from source to target through the ladder of `policy`.

    Arguments as `handoff` for a batch of one. Returns the target cache, its logits at the last
    position (1, V) and the record. `climb_all` (evaluation) climbs every rung whatever the policy
    decides and never falls back; `snapshots`, a cache with one row per rung, then receives each
    rung's cache, and the logits returned are per rung (R, V); `view_snapshots` (a map with two views)
    receives each rung's cache with the rows still mapped from the other view, whose last-position logits
    the record's `views_logits` holds (the evaluation scores answers under both: a candidate signal).
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
        return cache, logits, GateResult("fallback", 1.0, "the policy always falls back: the target prefilled "
                                         "the span itself, nothing was mapped", [], result, 1.0, source_prefilled=False)
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
        mapper.plain().apply_scored(source, source_cache, target, views, m.positions, rank=False)
        views_map_s = _now(target) - t
    t = _now(target)
    w = n - target_kept
    scores = m.scores[0, :w].clone()  # (W,)
    order = scores.float().clone()
    order[-1] = float("inf")  # the last position first: every rung computes it
    order = order.argsort(descending=True, stable=True) + target_kept  # (W,) positions, best first
    timings["score"] += _now(target) - t

    err = [0.0, 0.0]  # squared error of the mapped rows recomputed so far, and their squared norm
    measure = climb_all  # row_error is a candidate signal the evaluation records; serving does not pay for it

    def run(new: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:  # recompute `new` (with the last)
        fresh = new  # (the last position's mapped row is measured once, at rung 0)
        mapped = [c[:, 0, :, fresh].double() for c in (cache.k, cache.v)] if measure else []  # (L, H, m, D)
        t = _now(target)
        new = torch.unique(torch.cat([new, order[:1]]))  # ascending
        tok, pos = subset(whole, [new])
        lg = target.forward(tok, pos, cache).logits[0]
        secs = _now(target) - t
        for c, before in zip((cache.k, cache.v), mapped):  # (outside the timed recompute)
            exact = c[:, 0, :, fresh].double()
            err[0] += (exact - before).pow(2).sum().item()
            err[1] += exact.pow(2).sum().item()
        if views is None:
            return lg, secs, 0.0, 0.0
        t = _now(target)  # the same rung with the rows still mapped from the other view: the last position again
        for mine, other in ((cache.k, views.k), (cache.v, views.v)):
            other[:, 0, :, new] = mine[:, 0, :, new]  # (L, Hkv, m, D): the rows this rung recomputed
        last_tok, last_pos = subset(whole, [order[:1]])
        other_lg = target.forward(last_tok, last_pos, views).logits[0]
        secs_views = _now(target) - t
        other_logits.append(other_lg)
        return lg, secs, js_bits(lg, other_lg), secs_views

    def row_error() -> float:
        return err[0] / err[1] if err[1] > 0 else 0.0

    other_logits: list[torch.Tensor] = []  # the other view's last-position logits, rung 0 first
    prev, plain_s, plain_views, plain_views_s = run(order[:1])  # rung 0: plain transfer
    plain = prev
    rungs = [Rung(0.0, 1, 0.0, True, _outside(scores, order[:1] - target_kept), plain_s, *_confidence(prev), 0.0,
                  row_error(), plain_views, plain_views_s)]
    per_rung, done, accepted = [], 1, None
    for k, rho in enumerate(policy.rungs):
        if not climb_all and policy.max_rungs is not None and k >= policy.max_rungs:
            break  # the policy falls back here rather than climb further
        want = budget(rho, w)
        lg, secs, js_views, views_s = run(order[done:want])
        top = order[:want] - target_kept
        rung = Rung(rho, want, js_bits(lg, prev), bool(lg.argmax() == prev.argmax()), _outside(scores, top), secs,
                    *_confidence(lg), js_bits(lg, plain), row_error(), js_views, views_s)
        rungs.append(rung)
        done, prev = want, lg
        if snapshots is not None:
            snapshots.row(k).copy_prefix(cache, n)
        if view_snapshots is not None and views is not None:
            view_snapshots.row(k).copy_prefix(views, n)
        per_rung.append(lg)
        if accepted is None and _accepts(policy.threshold, policy.min_margin, rung.signal(policy.signal), rung.margin):
            accepted = k
            if not climb_all:
                break
    chosen = order[:done].sort().values.tolist()
    timings["recompute"] = sum(r.seconds for r in rungs)
    if views is not None:
        timings["views"] = views_map_s + sum(r.views_seconds for r in rungs)  # mapping the other view, last passes
    result = HandoffResult([chosen], [scores.cpu()], [(target_kept, n)], timings=timings)
    if climb_all:
        return cache, torch.stack(per_rung), GateResult(
            "ladder", policy.rungs[-1], "climbed every rung", rungs, result, done / w,
            views_logits=torch.stack(other_logits[1:]) if views is not None else None)
    if accepted is not None:
        r = rungs[accepted + 1]
        why = (f"js {r.js:.4g} <= {policy.threshold:.4g} bits against rho={rungs[accepted].rho:g}" if policy.signal == "js"
               else f"js_views {r.js_views:.4g} <= {policy.threshold:.4g} bits (the map's two views agree)") + (
            f", margin {r.margin:.3g} >= {policy.min_margin:.3g} nats" if policy.min_margin is not None else "")
        return cache, prev[None], GateResult("accept", r.rho, why, rungs, result, r.recomputed / w)
    logits = own_prefill(cache, timings)
    climbed = "" if policy.max_rungs is None or policy.max_rungs >= len(policy.rungs) else (
        f" in the first {policy.max_rungs}")
    sig = policy.signal
    why = f"no rung{climbed} had {sig} <= {policy.threshold:.4g} bits" + (
        f" with margin >= {policy.min_margin:.3g} nats" if policy.min_margin is not None else "") + (
        f" (last: {sig} {rungs[-1].signal(sig):.4g}, margin {rungs[-1].margin:.3g})" if len(rungs) > 1 else "")
    result.positions = [list(range(target_kept, n))]
    return cache, logits, GateResult("fallback", 1.0, why, rungs, result, 1.0)


# -- the policy's decision on recorded ladders, and its fit ----------------------------------

def _accepts(threshold: float, min_margin: float | None, js: float, margin: float) -> bool:
    return js <= threshold and (min_margin is None or margin >= min_margin)


def decide(js: list[float], threshold: float, margins: list[float] | None = None,
           min_margin: float | None = None, max_rungs: int | None = None) -> int | None:
    """The rung (index into the policy's rungs) a policy accepts, given each rung's js (and top-2
    margin), climbing at most `max_rungs`; None: fallback."""
    for k, d in enumerate(js[:max_rungs]):
        if _accepts(threshold, min_margin, d, margins[k] if margins is not None else 0.0):
            return k
    return None


def candidate_thresholds(ladders: list[list[float]]) -> list[float]:
    """Every threshold at which some decision changes, ascending, with 'always fall back' first."""
    return [-1.0, *sorted({d for js in ladders for d in js})]


def fit_threshold(groups: dict[str, list[tuple]], bounds: dict[str, float],
                  margins: bool = False) -> tuple[float, float | None, dict[str, dict], int | None]:
    return fit_thresholds(groups, [bounds], margins)[0]


def fit_thresholds(groups: dict[str, list[tuple]], bounds_list: list[dict[str, float]],
                   margins: bool = False) -> list[tuple[float, float | None, dict[str, dict], int | None]]:
    """The policy that computes least while every group's mean loss stays within its bound.

    `groups`: per task, per held-apart item, (js per rung, loss per rung, cost per rung[, margin
    per rung]) where loss is what accepting that rung costs against the target's own answer (1 for
    a changed multiple-choice answer, the bpb increase for a continuation) and cost the recomputed
    share; a fallback loses nothing. Thresholds are searched over every observed js, with `margins`
    a floor on the top-2 margin over deciles of the observed margins, and the most rungs to climb
    before falling back (`GatePolicy.max_rungs`). What is minimised is the work: the share of
    positions the target computes, a fallback counting 1 plus the rungs it climbed first (they were
    wasted), so a policy that would fall back anyway does so early. Ties go to the larger threshold.
    Returns, per set of bounds, the threshold, the margin floor (None: unused), per group what they
    give (loss, cost with a fallback as 1.0, work, fallback share), and the most rungs (None: all).
    """
    def outcome(th: float, mm: float | None, mr: int | None) -> dict[str, dict]:
        res = {}
        for g, items in groups.items():
            loss = cost = work = fell = 0.0
            for it in items:
                js, ls, cs = it[0], it[1], it[2]
                k = decide(js, th, it[3] if mm is not None else None, mm, mr)
                if k is None:
                    climbed = rungs_climbed(len(js), mr)
                    fell, cost = fell + 1, cost + 1.0
                    work += 1.0 + (cs[climbed - 1] if climbed else 0.0)
                else:
                    loss, cost, work = loss + ls[k], cost + cs[k], work + cs[k]
            n = max(1, len(items))
            res[g] = {"loss": loss / n, "cost": cost / n, "work": work / n, "fallback": fell / n, "n": len(items)}
        return res

    floors: list[float | None] = [None]
    if margins:
        import numpy as np

        ms = [m for items in groups.values() for it in items for m in it[3]]
        floors += sorted({float(q) for q in np.quantile(ms, np.linspace(0.1, 0.9, 9))}) if ms else []
    rungs = max((len(it[0]) for items in groups.values() for it in items), default=0)
    ths = candidate_thresholds([it[0] for items in groups.values() for it in items])
    table = [(-1.0, None, outcome(-1.0, None, 0), 0)]  # fall back at once, nothing mapped (any threshold)
    table += [(th, mm, outcome(th, mm, mr), mr) for mr in [*range(1, rungs), None] for mm in floors for th in ths]
    fits = []
    for bounds in bounds_list:
        best = (math.inf, -1.0, None, None, None)  # (mean work over groups, threshold, floor, outcome, max rungs)
        for th, mm, out, mr in table:  # (one sweep, read for every set of bounds)
            if all(o["loss"] <= bounds[g] + 1e-12 for g, o in out.items()):
                c = sum(o["work"] for o in out.values()) / len(out)
                if c < best[0] - 1e-12 or (abs(c - best[0]) <= 1e-12 and mm == best[2] and mr == best[4]
                                           and th > best[1]):
                    best = (c, th, mm, out, mr)
        _, th, mm, out, mr = best
        fits.append((th, mm, out if out is not None else outcome(th, mm, mr), mr))
    return fits
