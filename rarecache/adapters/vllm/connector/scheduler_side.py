"""The scheduler half of RarecacheConnector: which requests are handed off, and the request-only rule.

vLLM runs this half in its engine core, next to the scheduler and the prefix cache, with no
model and no paged cache. It decides, once per request, whether a peer's rows in the store
cover a block-aligned prefix worth claiming (`get_num_new_matched_tokens`), unpublishes the
claimed blocks from the prefix cache as soon as vLLM allocates them and every step after
(`update_state_after_alloc`, `build_connector_meta`), and on finish either queues the
request's rows for capture or, for a handed-off request, reports what was done and files
nothing (`request_finished`). The worker half (worker_side.py) does what the metadata built here
tells it. The rules and why they are enough: connector.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ....errors import RarecacheError
from .. import INSTALL_HINT

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.logger import init_logger
except ImportError as _e:
    raise RarecacheError(f"rarecache.adapters.vllm.connector.scheduler_side needs vllm ({_e}); "
                         f"{INSTALL_HINT}") from None

from ..rowstore.interface import CHUNK, Hit, Miss, StoreDown
from .core import QUERY_SELECTORS, RequestParams, check_peer_fits, check_peer_layout, claim, request_params

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
    rho: float = 0.0  # as decided (for the record)
    prompt_len: int = 0
    record: str | None = None  # the request's record name: the worker files what the load did
    lease: str | None = None  # the store's lease on the entry, released once it is read
    tail: list[int] = field(default_factory=list)  # a query-aware selector: the tokens after the claim (pass 1)


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
    lease: str | None = None


class SchedulerSide:
    """RarecacheConnector's scheduler hooks (a mixin: settings, store and block_size come from its __init__)."""

    def _init_scheduler(self) -> None:
        self._decided: dict[str, _Decision | None] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._handed: set[str] = set()
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._salts: OrderedDict[str, str] = OrderedDict()
        self._peer_configs: dict[str, Any] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._decided:
            info = self._info.setdefault(rid, {})
            try:
                self._decided[rid] = self._decide(request, num_computed_tokens, info)
            except StoreDown as e:  # the store is down: the model prefills the prompt itself
                self._decided[rid] = None
                info.update(status="fallback_reprefill", fallback="store_down", reason=str(e))
                logger.warning("rarecache: request %s: %s", rid, e)
            except (RarecacheError, OSError) as e:  # a bad parameter or store: no handoff, never a dead engine
                self._decided[rid] = None
                info.update(status="unsupported", error=str(e))
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
        if not params.handoff:
            return None
        if not self.settings.peers:
            info.update(status="unsupported", reason="this engine has no map into its model")
            return None
        tokens = list(request.prompt_token_ids or [])
        if not salt:
            info.update(status="unsupported", reason="no cache_salt: a handoff needs a salt unique to the request")
            return None
        if reused or num_computed > 0:
            info.update(status="unsupported",
                        reason="the cache_salt was used by another request: a handoff needs a fresh one")
            return None
        rho = self.settings.rho if params.rho is None else params.rho
        selector = params.selector or self.settings.selector
        seed = self.settings.seed if params.seed is None else params.seed
        scope = params.scope or salt
        best: tuple[str, Hit] | None = None
        miss: Miss | None = None
        for name, peer in self.settings.peers.items():
            found = self.store.find(peer.identity, scope, tokens)
            if isinstance(found, Miss):
                miss = found if miss is None or found.reason != "no_entry" else miss
                continue
            if best is not None and found.length <= best[1].length:
                continue
            try:
                self._peer_config(name)  # refuses a peer whose rows the map cannot read
            except StoreDown:
                raise
            except RarecacheError as e:
                miss = Miss("identity_mismatch", str(e))
                continue
            best = (name, found)
        if best is None:
            miss = miss or Miss("no_entry", "no peer rows for this prompt in the store")
            info.update(status="fallback_reprefill", fallback=miss.reason, reason=miss.detail)
            return None
        n, k = claim(len(tokens), best[1].length, self.block_size, rho, selector)
        if n == 0:
            info.update(status="fallback_reprefill", fallback="no_entry",
                        reason=f"the peer rows cover {best[1].length} tokens: less than a block to claim")
            return None
        lease = self.store.lease(best[1])  # kept from eviction until the worker has read it
        return _Decision(best[0], best[1], n, k, rho, selector, seed, len(tokens), params, lease)

    def _peer_config(self, name: str):
        if name not in self._peer_configs:
            peer = self.settings.peers[name]
            cfg = self.store.model_config(peer.identity)
            if cfg is None:
                raise RarecacheError(f"the store has rows of {peer.name} but no record of its config")
            check_peer_fits(peer.mapper, cfg, self.settings.config)
            check_peer_layout(peer, cfg)  # a pinned manifest names the peer's KV layout
            self._peer_configs[name] = cfg
        return self._peer_configs[name]

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        d = self._decided.get(rid)
        if d is None:
            return
        if num_external_tokens == 0:
            self.store.release(d.lease)
            self._info.setdefault(rid, {}).update(status="fallback_reprefill", fallback="no_entry",
                                                  reason="vLLM did not take the claimed tokens")
            return
        block_ids = list(blocks.get_block_ids()[0])[: d.tokens // self.block_size]
        self._evict(block_ids)  # vLLM published them at allocation: unpublish before anyone looks
        self._handed.add(rid)
        tail = list(request.prompt_token_ids[d.tokens :]) if d.selector in QUERY_SELECTORS and d.recompute else []
        self._loads.append(LoadSpec(rid, d.hit.entry, d.peer, list(request.prompt_token_ids[: d.tokens]),
                                    block_ids, d.recompute, d.selector, d.seed, d.rho, d.prompt_len,
                                    d.params.record, d.lease, tail))
        done = {"peer": d.peer, "tokens": d.tokens, "prompt": d.prompt_len, "rho": d.rho, "selector": d.selector,
                "recomputed": d.recompute, "tail": d.prompt_len - d.tokens}
        if d.params.debug:
            done["block_ids"] = block_ids
        # claimed: the worker's load makes it `applied` (its record says so), or a fallback with the reason
        self._info.setdefault(rid, {}).update(handoff=done, status="claimed")

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
