"""What `rarecache serve --engine vllm` runs with (`VllmServeConfig`) and the budget a request gets under it.

Apart from the service (serving.py) because both are checked before an engine starts, and a
request's budget before it is queued: the same rules and the same `Budget` as our own engine's
(serve/settings.py), with the engine's selectors, and the quality gate in the shape this path serves
(vllm_gate.py), whose one rung is the budget's ρ (`rung`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ....defaults import MIN_HANDOFF_TOKENS, SERVED
from ....dtypes import dtype_name, gpu_or_cpu
from ....errors import RarecacheError
from ....serve.settings import Budget, check_min_handoff
from ....transfer.gate.policy import GatePolicy, gate_decides
from ....transfer.handoff import HandoffConfig, check_rho
from ..connector.core import ENGINE_DEFAULT, check_selector
from ..rowstore.interface import CHUNK
from .vllm_gate import check_vllm_gate, gate_rho


@dataclass(frozen=True)
class VllmServeConfig:
    store: str | Path  # the row store both engines share: a directory or redis://HOST:PORT/DB (rowstore/interface.py)
    rho: float = SERVED.rho  # the served default, as `rarecache serve`
    selector: str | None = None  # None: a gate's own, else ENGINE_DEFAULT (the served fallback: below)
    dtype: str = "auto"  # auto: bfloat16 on a GPU or a CPU with native bf16, else float32 (dtypes.py); resolved here
    max_batch: int = 8  # vLLM's max_num_seqs, per engine
    max_new_tokens: int = 1024  # the most one request may ask for
    max_prompt_chars: int = 200_000
    kv_cache_bytes: int = 2 << 30  # each engine's paged cache
    block_size: int | None = None  # vLLM's default when None
    max_model_len: int | None = None
    compile: bool = False  # let vLLM compile (torch.compile / CUDA graphs); eager is the tested path
    tensor_parallel_size: int = 1  # each engine's ranks (the connector writes each rank's KV heads)
    request_budget: bool = True  # a request may name its own rho and selector (False: only the service's)
    store_bytes: int | None = None  # a directory store's capacity, LRU beyond it (None: unbounded)
    store_ttl: float | None = None  # seconds a stored entry lives (None: until evicted)
    accept_poor_map: bool = False  # serve maps that fit badly (Mapper.fit_problems), refused otherwise
    gate: GatePolicy | None = None  # the quality gate decides each request's handoff (vllm_gate.py); selector: its own
    min_handoff_tokens: int = MIN_HANDOFF_TOKENS  # shorter prompts are read by the model itself (serve/settings.py)

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype, gpu_or_cpu()))
        check_rho(self.rho)
        if self.selector is None:
            gated = self.gate is not None and not self.gate.always_falls_back
            object.__setattr__(self, "selector", self.gate.selector if gated else ENGINE_DEFAULT)
        check_selector(self.selector)
        check_min_handoff(self.min_handoff_tokens)
        if self.gate is not None:
            check_vllm_gate(self.gate)
            if not self.gate.always_falls_back and self.selector != self.gate.selector:
                raise RarecacheError(f"the gate policy hands off with its own selector ({self.gate.selector}), "
                                     f"not {self.selector}")
        if self.max_batch < 1 or self.max_new_tokens < 1 or self.kv_cache_bytes <= 0:
            raise RarecacheError("max_batch and max_new_tokens must be >= 1 and the KV cache size > 0")
        if self.block_size is not None and (self.block_size < CHUNK or self.block_size % CHUNK):
            raise RarecacheError(f"the block size must be a positive multiple of {CHUNK} (vLLM CPU: of 32), "
                                 f"not {self.block_size}")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise RarecacheError(f"tensor_parallel_size must be a positive integer, not {self.tensor_parallel_size!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise RarecacheError(f"max_model_len must be >= 2, not {self.max_model_len}")
        if self.store_bytes is not None and self.store_bytes <= 0 or self.store_ttl is not None and self.store_ttl <= 0:
            raise RarecacheError("the store's capacity and entry lifetime must be > 0")

    @property
    def budget(self) -> Budget:
        """The server's own budget (a gated server's: the gate policy's, at its one rung)."""
        return request_budget(self)


def rung(budget: Budget) -> float:
    """The ρ a request under `budget` asks the engine for: its fixed ρ, or the gate's one rung."""
    return gate_rho(budget.gate) if budget.gate is not None else budget.handoff.rho


def request_budget(cfg: VllmServeConfig, rho: float | str | None = None, selector: str | None = None) -> Budget:
    """A request's own budget instead of the server's, checked as our own engine checks it (serve/settings.py
    `request_budget`), with the engine's selectors; the gate policy's when the gate decides (`rho` "auto",
    or nothing named on a gated server)."""
    gate = cfg.gate
    if (rho is None and selector is None and gate is not None) or gate_decides(gate, rho, selector):
        return Budget(HandoffConfig.named(gate_rho(gate), gate.selector), gate)
    own = (cfg.rho if rho is None else check_rho(rho, "rarecache.rho"),
           cfg.selector if selector is None else check_selector(selector, "rarecache.selector"))
    if not cfg.request_budget and (gate is not None or own != (cfg.rho, cfg.selector)):
        raise RarecacheError("this server hands off with its own budget only (rarecache serve "
                             "--no-request-budget): leave rarecache.rho and selector out")
    return Budget(HandoffConfig.named(*own))
