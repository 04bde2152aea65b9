"""The quality gate's policy: a handoff that never silently costs accuracy climbs a ladder of budgets
until the answer stops moving, or falls back to the target's own prefill.

A fixed ρ is too much for most prompts and too little for some (0-shot MMLU loses accuracy at every
selector at ρ = 0.3). The gate spends the budget in rungs (default ρ = 0.1, 0.2, 0.3, 0.5) over one
ordering of the positions by the selector's scores. Rung 0 is plain transfer (the last position only)
through the map's stored fit. After each rung the target's next-token distribution at the last position
is compared with the rung below (`js`, bits), or (`js_views`) with the same rung's when the rows still
mapped come from the map's other fit (`Mapper.plain`); or the policy reads `nll`, the target's mean
surprisal (bits per token) at the prompt's own next tokens where the rung recomputed, which the rung's pass
computes the hidden states of anyway (an LM-head product per recomputed position more). The policy
accepts the first rung whose signal is at most its threshold; past the last rung it climbs, the target
prefills the handed-off span itself
(exact: every row is rewritten), reusing the rows it held before the handoff. The ladder runs in
`ladder.py`; the threshold is fitted offline on held-apart items (`eval/gate_fit.py`).

**Every rung is a direct handoff at its ρ** (tested for every selector). A row the target recomputes
attends to the rows before it, so a row recomputed at a lower rung is stale as soon as a higher rung
recomputes a position before it. Climbing therefore reruns, at each rung, every chosen position from
the first one the rung adds (`ladder.rung_run`); rows before it are exactly what a direct handoff
computes and stay. The cost is measured, not assumed: each rung records the positions it ran (`run`),
and the fit below minimises their sum. With `suffix` every rung adds positions before all the others,
so it reruns its whole set and climbing to the top costs Σρ = 0.1 + 0.2 + 0.3 + 0.5 = 1.1 prefills
against 0.5 for a direct handoff at the top rung (tested). Measured on the tests' tiny random pair
(prompts of 37 and 23 tokens; the top rung holds 0.51-0.52 of them) the whole ladder ran 1.16/1.17
prefills with suffix, 1.14/1.09 random, 0.87/0.91 suffix+attn, 0.81/0.87 rank and 0.62/0.65
attn-source (the positions the source attends to come early, so later rungs add late ones). The
earlier ladder, which recomputed only the added positions, cost about ρ but was no handoff at its
rungs: recomputed from committed records at ρ = 0.3 its answer differed from a direct handoff's on 29%
of MMLU items. On the real pair the figures come from recorded ladders (`run`); none were recorded
for this change.

**Kept design: exact climbing from a rung chosen before the handoff.** A policy names `first_rung`: the
ladder starts there (the first rung climbed is one direct handoff, compared with plain transfer) and
climbs at most `max_rungs`. `first_rung = f, max_rungs = 1` is "choose the rung before the handoff,
run one direct handoff, accept or fall back"; `first_rung = 0, max_rungs = None` is full climbing. The
fit (`eval/gate_fit.py`) picks among them by the measured work (Σ of the rungs' run shares, a fallback
adding the target's own prefill), so whichever is cheaper on held-apart items for the same loss bound
is what is served. The first rung is one per policy, not per prompt: choosing it per prompt (from
prompt length, structure and the map's score mass) waits for held items enough to fit such a rule.

A policy that can accept nothing (a negative threshold, or `max_rungs` 0) decides before the handoff:
the target prefills at once and nothing is mapped, so it costs exactly the target's own prefill.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import RarecacheError
from ...registry import RANK
from ..handoff import HandoffConfig, HandoffResult

RUNGS = (0.1, 0.2, 0.3, 0.5)
POLICY_FORMAT = "rarecache-gate-policy/1"
SIGNALS = ("js", "js_views", "nll")  # what a policy thresholds (GatePolicy.signal; module docstring)


@dataclass(frozen=True)
class GatePolicy:
    # rank, not the served default (suffix): every suffix rung adds positions before all the others and
    # reruns its whole set, so its ladder costs about twice rank's (module docstring); a served policy names
    # its selector anyway (fitted on recorded ladders, eval/gate_report.py)
    selector: str = RANK
    rungs: tuple[float, ...] = RUNGS
    threshold: float = 0.0  # accept rung k when js(rung k, rung k-1) <= threshold (bits); < 0: always fall back
    min_margin: float | None = None  # and, if set, when its top-2 log-probability margin (nats) is at least this
    fitted: dict = field(default_factory=dict, compare=False, hash=False)  # what it was fitted on
    max_rungs: int | None = None  # climb at most this many rungs from first_rung, then fall back (None: all;
    # 0: at once, unmapped)
    signal: str = "js"  # SIGNALS: the rung-to-rung divergence, the two views' (needs a map with a plain view), or
    # the target's surprisal at the prompt's own tokens it recomputed
    first_rung: int = 0  # the ladder starts at rungs[first_rung] (a direct handoff there; module docstring)

    def __post_init__(self):
        rungs = tuple(self.rungs)
        if not rungs or any(not 0 < r < 1 for r in rungs) or any(b <= a for a, b in zip(rungs, rungs[1:])):
            raise RarecacheError(f"gate rungs must increase strictly inside (0, 1), got {list(rungs)}")
        for name, v in (("threshold", self.threshold), ("min_margin", self.min_margin)):
            if v is None and name == "min_margin":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise RarecacheError(f"gate {name} must be a number, got {v!r}")
        if HandoffConfig(rungs[0], self.selector).scorer.two_pass:  # (validates the selector)
            raise RarecacheError(f"the gate climbs one order of positions; {self.selector} chooses its positions "
                                 "from a first pass at each budget: give the gate a one-pass selector")
        f = self.first_rung
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < len(rungs):
            raise RarecacheError(f"gate first_rung must be a whole number from 0 to {len(rungs) - 1}, got {f!r}")
        m, top = self.max_rungs, len(rungs) - f
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= top):
            raise RarecacheError(f"gate max_rungs must be a whole number from 0 to {top} (or null), got {m!r}")
        if self.signal not in SIGNALS:
            raise RarecacheError(f"gate signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        object.__setattr__(self, "rungs", rungs)

    @property
    def climbed(self) -> tuple[float, ...]:
        """The rungs this policy may climb, in order: from `first_rung`, at most `max_rungs` of them."""
        return self.rungs[self.first_rung:][: self.max_rungs]

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
                           "level": lv}, lv.get("max_rungs"), self.signal, lv.get("first_rung", 0))

    def to_json(self) -> str:
        data = {"format": POLICY_FORMAT, **asdict(self), "rungs": list(self.rungs)}
        if self.signal == "js":  # left out: files (and the gate rules results record) stay as before
            del data["signal"]
        if self.first_rung == 0:  # (the same)
            del data["first_rung"]
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
        extra = set(data) - {"format", "selector", "rungs", "threshold", "min_margin", "fitted", "max_rungs", "signal",
                             "first_rung"}
        if extra:
            raise RarecacheError(f"{path}: unknown gate policy field(s) {', '.join(sorted(extra))}")
        rungs, sel, fitted = data.get("rungs"), data.get("selector"), data.get("fitted", {})
        if (not isinstance(rungs, list) or not all(isinstance(r, (int, float)) for r in rungs)
                or not isinstance(sel, str) or not isinstance(fitted, dict)):
            raise RarecacheError(f"{path}: gate policy needs selector (text), rungs (numbers), fitted (object)")
        try:
            return cls(sel, tuple(float(r) for r in rungs), data.get("threshold"), data.get("min_margin"), fitted,
                       data.get("max_rungs"), data.get("signal", "js"), data.get("first_rung", 0))
        except OverflowError:  # an integer too large for a float (JSON allows any)
            raise RarecacheError(f"{path}: a gate policy number is too large") from None


def gate_rule(policy: GatePolicy) -> dict:
    """What decides a request under `policy` (selector, rungs, threshold, margin floor, max rungs) as
    its file writes it, without what it was fitted on: what results record it ran with."""
    return {k: v for k, v in json.loads(policy.to_json()).items() if k not in ("format", "fitted")}


def rungs_climbed(rungs: int, max_rungs: int | None) -> int:
    """How many of a ladder's `rungs` (from the first climbed) a policy climbs before it falls back."""
    return rungs if max_rungs is None else min(max_rungs, rungs)


def gate_decides(gate: GatePolicy | None, rho, selector) -> bool:
    """Whether a request's own budget (`rarecache.rho`, `rarecache.selector` in its body) leaves the budget to
    the server's gate policy `gate`: `rho` "auto" does (refused without a gate, or with another selector than
    the policy's); on a gated server a request naming a selector must name its rho too. The rule every
    engine's server applies (serve/settings.py, adapters/vllm/server/serve_config.py)."""
    if rho == "auto":
        if gate is None:
            raise RarecacheError("rarecache.rho auto needs a server started with --rho auto --gate-policy FILE")
        if selector is not None and selector != gate.selector:
            raise RarecacheError(f"rarecache.rho auto hands off with the gate policy's selector ({gate.selector}); "
                                 "leave selector out")
        return True
    if rho is None and selector is not None and gate is not None:
        raise RarecacheError("this server picks the budget per request (--rho auto): a request naming a selector "
                             "must name its rho too (a number, or \"auto\")")
    return False


def climbed_signals(signal: list[float], first_rung: int, from_plain: list[float] | None = None) -> list[float]:
    """A recorded ladder's signal per rung as a policy starting at `first_rung` sees it: `js` compares
    each rung with the rung below, and the first rung climbed with plain transfer (`from_plain`, the
    record's js_plain; a signal that compares no rungs, js_views, passes None)."""
    seq = list(signal[first_rung:])
    if first_rung and from_plain is not None and seq:
        seq[0] = from_plain[first_rung]
    return seq


@dataclass
class Rung:
    rho: float
    recomputed: int  # handed-off positions the rung's cache holds recomputed: a direct handoff's budget at rho
    js: float  # bits, this rung's last-position distribution against the rung below
    top1_same: bool  # same most likely next token as the rung below
    outside: float  # share of the selector's score mass on positions not recomputed
    seconds: float  # this rung's recompute
    margin: float = 0.0  # nats between the most and second most likely next token
    entropy: float = 0.0  # bits, of the next-token distribution
    js_plain: float = 0.0  # bits, against plain transfer (rung 0)
    row_error: float = 0.0  # relative squared error of the mapped rows at the rung's recomputed positions, against
    # the rows the rung computed there (recorded ladders only; so are the signals below but js_views)
    js_views: float = 0.0  # bits, this rung's last-position distribution against the same with the rows still
    # mapped taken from the map's other view (its plain-transfer fit); 0 where not measured
    views_seconds: float = 0.0  # that second last-position pass (and copying the rung's rows into it)
    run: int = 0  # positions this rung ran through the target (exact climbing reruns from the first one it adds)
    nll: float = 0.0  # bits per token: the target's surprisal at the prompt's own next tokens, at the rung's
    # recomputed positions (all but the last, which has no next token in the prompt)
    nll_shift: float = 0.0  # nll minus the source's own surprisal at the same positions (signed)
    nll_gap: float = 0.0  # mean |change| of those surprisals against the rung below where it recomputed them,
    # else against the source's
    probe_cos: float = 0.0  # attention-output cosine of a few probe queries over this rung's cache against
    # over the mapped cache (transfer/diagnostics.py's cosine, the rung's rows standing in for the exact ones)
    row_error_layers: list[float] = field(default_factory=list)  # row_error per target layer
    signal_seconds: dict[str, float] = field(default_factory=dict)  # what measuring each signal cost here

    def signal(self, name: str) -> float:
        """The value a policy with `signal` name (SIGNALS) thresholds."""
        if name not in SIGNALS:
            raise RarecacheError(f"unknown gate signal {name!r}")
        return getattr(self, name)


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

    @property
    def summary(self) -> str:
        """One line: what the gate decided and why."""
        return gate_summary(self.decision, self.rho, self.reason)

    def record(self) -> dict:
        """JSON-ready: what the response's `rarecache` object and result files show."""
        return {"decision": self.decision, "rho": self.rho, "reason": self.reason, "summary": self.summary,
                "recomputed_share": self.recomputed_share, "source_prefilled": self.source_prefilled,
                "rungs": [{k: _rounded(v) for k, v in asdict(r).items()} for r in self.rungs]}


ALWAYS_FALLS_BACK = "the policy always falls back: the target prefilled the span itself, nothing was mapped"


def gate_summary(decision: str, rho: float, reason: str) -> str:
    """One line: what the gate decided (at rho) and why; every engine's responses say it in these words."""
    if decision == "accept":
        return f"accepted at rho {rho:g}: {reason}"
    if decision == "fallback":
        return f"fell back to the target's own prefill: {reason}"
    return f"{decision}: {reason}"


def accept_reason(policy: GatePolicy, value: float, margin: float = 0.0, against: str = "plain transfer") -> str:
    """Why `policy` accepted a rung whose signal is `value` (js: against the rung below, named `against`)."""
    t = policy.threshold
    why = {"js": f"js {value:.4g} <= {t:.4g} bits against {against}",
           "js_views": f"js_views {value:.4g} <= {t:.4g} bits (the map's two views agree)",
           "nll": f"nll {value:.4g} <= {t:.4g} bits per token (the target's surprisal at the prompt's own tokens it "
                  "recomputed)"}[policy.signal]
    return why + (f", margin {margin:.3g} >= {policy.min_margin:.3g} nats" if policy.min_margin is not None else "")


def fallback_reason(policy: GatePolicy, last: float | None = None, margin: float | None = None) -> str:
    """Why `policy` fell back after its rungs, the last of which measured `last` (and `margin`, if known)."""
    climbed = "" if len(policy.climbed) == len(policy.rungs) else (
        f" of {', '.join(f'{x:g}' for x in policy.climbed)}")
    sig = policy.signal
    seen = "" if last is None else (f" (last: {sig} {last:.4g}"
                                    + ("" if margin is None else f", margin {margin:.3g}") + ")")
    return f"no rung{climbed} had {sig} <= {policy.threshold:.4g} bits" + (
        f" with margin >= {policy.min_margin:.3g} nats" if policy.min_margin is not None else "") + seen


def _rounded(v):
    if isinstance(v, float):
        return round(v, 6)
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return {k: _rounded(x) for k, x in v.items()} if isinstance(v, dict) else v


def js_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    """Jensen–Shannon divergence in bits between the softmax distributions of logits a, b (V,)."""
    la, lb = F.log_softmax(a.double(), -1), F.log_softmax(b.double(), -1)
    m = torch.logaddexp(la, lb) - math.log(2)
    js = 0.5 * ((la.exp() * (la - m)).sum() + (lb.exp() * (lb - m)).sum())
    return max(0.0, js.item() / math.log(2))


def _accepts(threshold: float, min_margin: float | None, js: float, margin: float) -> bool:
    return js <= threshold and (min_margin is None or margin >= min_margin)


def decide(js: list[float], threshold: float, margins: list[float] | None = None,
           min_margin: float | None = None, max_rungs: int | None = None) -> int | None:
    """The rung a policy accepts, as an index into the signals given (the rungs it climbs, in order:
    `climbed_signals`), with each one's top-2 margin, climbing at most `max_rungs`; None: fallback."""
    for k, d in enumerate(js[:max_rungs]):
        if _accepts(threshold, min_margin, d, margins[k] if margins is not None else 0.0):
            return k
    return None


