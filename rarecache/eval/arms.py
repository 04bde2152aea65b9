"""The arms of an evaluation: the target alone, the source alone, a handoff at some ρ and
selector (or the layer-prefix schedule) through one of the run's maps, or the quality gate's
ladder (`transfer/gate/policy.py`): every rung climbed and scored, so that any gate policy's decisions
can be read off the record afterwards (`eval gate`).

An arm's name keys its lines in a results file ("target", "rho=0.3/rank",
"rho=0.3/layer-prefix@wiki"), so it is spelled as users spell it and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RarecacheError
from ..registry import RANK
from ..transfer.handoff import HandoffConfig
from ..transfer.selectors import SELECTORS
from .report import arm_name, display

SEED = 0  # the random selector's seed


@dataclass(frozen=True)
class Arm:
    kind: str  # "target", "source", "handoff" or "ladder"
    rho: float = 0.0
    method: str = RANK  # a selector's name, or layer-prefix: the word HandoffConfig.named reads
    map: str = ""  # label of the map a handoff goes through ("" when the run has one unlabelled map)

    @property
    def name(self) -> str:
        if self.kind == "ladder":
            return f"ladder/{self.method}" + (f"@{self.map}" if self.map else "")
        return self.kind if self.kind != "handoff" else arm_name(self.rho, self.method, self.map)

    @property
    def label(self) -> str:
        return display(self.name)

    @property
    def config(self) -> HandoffConfig:
        """What a handoff arm runs."""
        return HandoffConfig.named(self.rho, self.method, SEED)

    @classmethod
    def parse(cls, spec: str, maps: tuple[str, ...] = ("",)) -> list[Arm]:
        """"target", "source", "RHO:SELECTOR" (one arm per map), "RHO:SELECTOR@MAP", or the gate's
        ladder "ladder:SELECTOR[@MAP]"."""
        if spec in ("target", "source"):
            return [cls(spec)]
        body, _, label = spec.partition("@")
        rho, _, method = body.partition(":")
        if label and label not in maps:
            raise RarecacheError(f"arm {spec!r} names map {label!r}; the run's maps: {', '.join(maps) or '(none)'}")
        if rho == "ladder":
            if method not in SELECTORS or SELECTORS[method].oracle or SELECTORS[method].two_pass:
                raise RarecacheError(f"bad arm {spec!r}: the ladder needs a deployable one-pass selector "
                                     f"({', '.join(k for k, v in SELECTORS.items() if not (v.oracle or v.two_pass))})")
            return [cls("ladder", 0.0, method, m) for m in ([label] if label else maps)]
        try:
            arms = [cls("handoff", float(rho), method or RANK, m) for m in ([label] if label else maps)]
            HandoffConfig.named(arms[0].rho, arms[0].method)  # validates
            return arms
        except ValueError:
            raise RarecacheError(f"bad arm {spec!r}: use target, source, RHO:SELECTOR[@MAP] (e.g. 0.3:rank) "
                                 "or ladder:SELECTOR[@MAP]") from None


def parse_arms(specs: list[str], maps: tuple[str, ...]) -> list[Arm]:
    arms: list[Arm] = []
    for spec in specs:
        arms += [a for a in Arm.parse(spec, maps) if a not in arms]
    return arms


def handoff_arm(spec: str, label: str = "") -> Arm:
    """One handoff "RHO:SELECTOR" through map `label`, read as `eval run --arms` reads it (the fidelity
    summary and the probe name arms this way); target, source, a ladder or an @MAP of its own are refused."""
    if "@" in spec or spec in ("target", "source") or spec.startswith("ladder:"):
        raise RarecacheError(f"bad arm {spec!r}: name a handoff as RHO:SELECTOR (e.g. 0.2:suffix); "
                             "the map goes with its own flag")
    return Arm.parse(spec, (label,))[0]
