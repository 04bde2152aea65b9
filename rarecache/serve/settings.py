"""What a chat server hands off with: the server's own budget (`ServiceConfig`) and a request's.

Kept apart from the scheduler (`serve/worker.py`) because both engines' services and the HTTP
front read it: `Budget` is the one budget type of every engine (serve/contract.py), a request's own
budget (the `rarecache` object of its body) is checked against the server's here, before any work is
queued, and `too_short` is the short-prompt rule both engines apply before they hand off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..defaults import MIN_HANDOFF_TOKENS
from ..errors import RarecacheError
from ..transfer.gate.policy import GatePolicy, gate_decides
from ..transfer.handoff import HandoffConfig, check_rho
from ..transfer.selectors import SELECTORS


@dataclass(frozen=True)
class Budget:
    """How one request's prompt is handed off, if it is: a fixed budget, or the quality gate's policy."""

    handoff: HandoffConfig
    gate: GatePolicy | None = None

    def __post_init__(self):
        for sel in (self.handoff.scorer, None if self.gate is None else SELECTORS[self.gate.selector]):
            if sel is not None and sel.oracle:
                raise RarecacheError(f"selector {sel.name} is an oracle (it reads the target's own prefill): "
                                     "for evaluation, not for serving")

    @property
    def selector(self) -> str:
        return self.gate.selector if self.gate is not None else self.handoff.name

    @property
    def rho(self) -> float | None:
        """The fixed share of handed-off positions recomputed; None where the gate picks it per request."""
        return None if self.gate is not None else self.handoff.rho

    def describe(self) -> dict:
        """The budget as `GET /health` shows it (a client checks what it can ask for)."""
        return {"rho": self.rho, "selector": self.selector, "gate": self.gate is not None}


def check_min_handoff(n) -> int:
    """A server's `min_handoff_tokens`: a whole number of tokens, 0 (hand off at any length) or more."""
    if type(n) is not int or n < 0:
        raise RarecacheError(f"the shortest prompt handed off must be a whole number of tokens >= 0, not {n!r}")
    return n


def too_short(min_handoff_tokens: int, prompt_tokens: int) -> bool:
    """The short-prompt rule (issue #54 item 4), one for every engine: a prompt of fewer tokens than the
    server's `min_handoff_tokens` is read by the model itself even where another model's rows would hand
    it off (status fallback_reprefill, reason short_prompt; serve/outcome.py): below that length mapping
    and scoring cost more than they save, or the handoff changes the answer."""
    return prompt_tokens < min_handoff_tokens


@dataclass(frozen=True)
class ServiceConfig:
    handoff: HandoffConfig = HandoffConfig()  # the served default (defaults.SERVED)
    gate: GatePolicy | None = None  # hand off through the quality gate (adaptive ρ, fallback) instead
    cache_bytes: int = 4 << 30  # budget for the held caches of all models together
    max_new_tokens: int = 1024  # the most one request may ask for
    max_prompt_chars: int = 200_000  # checked before tokenising
    max_batch: int = 8  # answers decoded together; past it, requests wait for a place
    request_budget: bool = True  # a request may name its own budget (False: only the server's own)
    heal: bool = False  # when idle, re-prefill the rows handoffs left, so later turns reuse exact rows
    min_handoff_tokens: int = MIN_HANDOFF_TOKENS  # shorter prompts are re-prefilled (`too_short`)

    def __post_init__(self):
        if self.max_batch < 1 or self.cache_bytes <= 0 or self.max_new_tokens < 1:
            raise ValueError("max_batch and max_new_tokens must be >= 1 and cache_bytes > 0")
        check_min_handoff(self.min_handoff_tokens)
        self.budget  # noqa: B018 - refuses an oracle selector

    @classmethod
    def started(cls, rho: float | None, selector: str, gate: GatePolicy | None = None, **settings) -> "ServiceConfig":
        """A server's config from how it was started: a fixed `rho` and `selector`, or (`rho` None) the gate
        policy, which hands off with its own selector and rungs; the fixed budget is then the served default,
        of which a request naming its own rho keeps only the seed (`request_budget`)."""
        if (rho is None) == (gate is None):
            raise ValueError("a server hands off with a fixed rho or through the gate, one of the two")
        return cls(HandoffConfig() if gate is not None else HandoffConfig.named(rho, selector), gate=gate, **settings)

    @property
    def budget(self) -> Budget:
        """The server's own budget: what a request that names none is handed off with."""
        return Budget(self.handoff, self.gate)


def request_budget(cfg: ServiceConfig, rho: float | str | None = None, selector: str | None = None) -> Budget:
    """A request's own budget (the `rarecache` object of its body) against the server's: `rho` a share
    in [0, 1] or "auto" (the server's gate policy), `selector` one the server may run (no oracle);
    a `selector` alone keeps the server's ρ (on a gated server it needs a `rho`), a `rho` alone the
    server's selector (on a gated server the policy's). Every mistake is a RarecacheError, raised
    before the request is queued."""
    server = cfg.budget
    if rho is None and selector is None:
        return server
    if selector is not None and not isinstance(selector, str):
        raise RarecacheError(f"rarecache.selector must be a selector's name, got {selector!r}")
    if gate_decides(cfg.gate, rho, selector):
        return server
    if rho is None:
        rho = cfg.handoff.rho
    rho = check_rho(rho, "rarecache.rho")
    if selector is not None:
        own = Budget(HandoffConfig.named(rho, selector, cfg.handoff.seed))
    elif cfg.gate is not None:
        own = Budget(HandoffConfig.named(rho, cfg.gate.selector, cfg.handoff.seed))
    else:
        own = Budget(replace(cfg.handoff, rho=rho))  # the server's selector or schedule, and seed
    if not cfg.request_budget and own != server:
        raise RarecacheError("this server hands off with its own budget only (rarecache serve "
                             "--no-request-budget): leave rarecache.rho and selector out")
    return own
