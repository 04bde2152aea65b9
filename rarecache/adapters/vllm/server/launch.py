"""`rarecache serve --engine vllm`: check the flags, find the pair and its maps, start both engines, serve;
and `bench_service`, the same pair of engines for `rarecache bench serve / load --engine vllm`.

commands/serve.py parses the flags both engines share and hands over here. Everything a
user can get wrong is refused before the first engine starts (each takes about a minute on a
small CPU): the vLLM settings by VllmServeConfig, the maps by VllmChatService. vLLM's CPU
thread settings are given defaults that use every core (engines.engine_environment), printed
so they can be repeated or overridden. The row store is a fresh private directory unless
`--store` names one to share (a directory, or a Redis server `redis://HOST:PORT/DB` that engines
on other hosts share too); a fresh one is removed at exit. `--store-gib` bounds a directory
store (LRU beyond it), `--store-ttl` every entry's life.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ....defaults import SERVED
from ....dtypes import cpu_capability
from ....errors import RarecacheError
from ..rowstore.interface import describe_store, is_url


def serve_vllm(args, names: tuple[str, str], api_key: str | None, gate=None) -> int:
    """`gate`: the quality gate's policy (--rho auto; `args.rho` is then None), checked here (vllm_gate.py)."""
    try:
        import uvicorn

        from ....serve.app import create_app
    except ImportError as e:
        raise RarecacheError(f"rarecache serve needs FastAPI and uvicorn ({e.name} is missing): "
                             "pip install 'rarecache[serve]'") from None
    import torch

    from ....models.store import resolve_model
    from .engines import engine_environment
    from .vllm_gate import gate_rho
    from .serving import VllmChatService, VllmServeConfig

    check_store_flags(args.store, args.store_gib, args.store_ttl)
    rho, selector = (args.rho, args.selector) if gate is None else (  # (a gate's own selector: VllmServeConfig's)
        gate_rho(gate), args.selector if gate.always_falls_back else None)
    fresh = args.store is None
    store = _store_path(args.store, "rarecache-rows-")
    try:
        cfg = VllmServeConfig(store=store, store_bytes=store_bytes(args.store_gib), store_ttl=args.store_ttl,
                              rho=rho, selector=selector, gate=gate, dtype=args.dtype,
                              max_batch=args.max_batch, max_new_tokens=args.max_tokens_limit,
                              kv_cache_bytes=int(args.cache_gib * (1 << 30)) // 2, block_size=args.block_size,
                              max_model_len=args.max_model_len, compile=args.compile,
                              tensor_parallel_size=args.tensor_parallel_size,
                              request_budget=args.request_budget, accept_poor_map=args.accept_poor_map,
                              min_handoff_tokens=args.min_handoff_tokens)
        paths = [resolve_model(m, cache_dir=args.cache_dir) for m in (args.source, args.target)]
        maps = {}
        for pair, path in (((names[0], names[1]), args.map), ((names[1], names[0]), args.reverse_map)):
            if path is not None:
                if not Path(path).is_file():
                    raise RarecacheError(f"no map file {path}")
                maps[pair] = Path(path)
        if (names[0], names[1]) not in maps:  # (serve fills the bundled pair's served map before this)
            raise RarecacheError("serve --engine vllm needs --map: the map fitted source -> target")
        if not torch.cuda.is_available():
            settings = engine_environment(tensor_parallel_size=cfg.tensor_parallel_size)
            print("rarecache: vLLM CPU threads: " + " ".join(f"{k}={v}" for k, v in settings.items()),
                  file=sys.stderr)
        service = VllmChatService(dict(zip(names, paths)), maps, cfg)
        try:
            app = create_app(service, default_max_tokens=args.default_max_tokens, max_waiting=args.max_waiting,
                             api_key=api_key, openapi_docs=args.openapi_docs)
            budget = f"rho {cfg.rho:g}, {cfg.selector}" if gate is None else "gate: " + (
                "always falls back" if gate.always_falls_back else
                f"{gate.selector}, rung {cfg.rho:g}, nll threshold {gate.threshold:.4g} bits")
            print(f"serving {' and '.join(names)} in vLLM (handoff {', '.join(f'{a} -> {b}' for a, b in maps)}, "
                  f"{budget}; row store {describe_store(store)}) on "
                  f"http://{args.host}:{args.port}/v1/chat/completions", file=sys.stderr)
            uvicorn.run(app, host=args.host, port=args.port, log_level="info")
        finally:
            service.close()
    finally:
        if fresh:
            shutil.rmtree(store, ignore_errors=True)
    return 0


def _store_path(store: str | Path | None, prefix: str) -> str | Path:
    """The row store a server or bench uses: the one named (a directory or a Redis address), else a
    fresh private directory under /dev/shm (the caller removes it)."""
    if store is not None:
        return str(store) if is_url(store) else Path(store).expanduser()
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))


def check_store_flags(store: str | Path | None, gib: float | None, ttl: float | None) -> None:
    """--store, --store-gib and --store-ttl, before anything starts."""
    if gib is not None and store is not None and is_url(store):
        raise RarecacheError("--store-gib caps a directory store; a Redis store is bounded by the server's own "
                             "maxmemory (with --maxmemory-policy allkeys-lru)")
    store_bytes(gib)
    if ttl is not None and not ttl > 0:
        raise RarecacheError(f"--store-ttl must be > 0 seconds, not {ttl}")


def store_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if not gib > 0:
        raise RarecacheError(f"--store-gib must be > 0, not {gib}")
    return int(gib * (1 << 30))


@contextmanager
def bench_service(source: str, target: str, map_path: Path, *, dtype: str, cache_dir: Path | None = None,
                  block_size: int = 32, kv_cache_bytes: int = 2 << 30, max_batch: int = 8,
                  max_model_len: int | None = None, selector: str = SERVED.fallback, store: str | Path | None = None,
                  store_gib: float | None = None,
                  store_ttl: float | None = None) -> Iterator[tuple[Any, tuple[str, str], dict[str, Any]]]:
    """Both models in vLLM engines for the benches, the target taking handoffs from the source
    through `map_path`, on a fresh row store (removed after) unless `store` names one. Yields the
    service, the two served names and the settings both arms run under (vLLM's CPU threads, the
    scheduler's limits, versions), for the benches' JSON."""
    import torch

    from ....models.store import resolve_model
    from ....serve.names import model_id
    from .engines import engine_environment
    from .serving import VllmChatService, VllmServeConfig

    names = model_id(source), model_id(target)
    if names[0] == names[1]:
        raise RarecacheError(f"source and target would both be named {names[0]!r}")
    if not Path(map_path).is_file():
        raise RarecacheError(f"no map file {map_path}")
    fresh = store is None
    store = _store_path(store, "rarecache-bench-rows-")
    try:
        cfg = VllmServeConfig(store=store, store_bytes=store_bytes(store_gib), store_ttl=store_ttl,
                              selector=selector, dtype=dtype, max_batch=max_batch,
                              kv_cache_bytes=kv_cache_bytes, block_size=block_size, max_model_len=max_model_len,
                              min_handoff_tokens=0)  # (the benches time handoffs at every length)
        paths = [resolve_model(m, cache_dir=cache_dir) for m in (source, target)]
        env = {} if torch.cuda.is_available() else engine_environment()
        if env:
            print("rarecache: vLLM CPU threads: " + " ".join(f"{k}={v}" for k, v in env.items()), file=sys.stderr)
        service = VllmChatService(dict(zip(names, paths)), {names: Path(map_path)}, cfg)
        try:
            yield service, names, {**engine_settings(service, names[1]), "environment": env}
        finally:
            service.close()
    finally:
        if fresh:
            shutil.rmtree(store, ignore_errors=True)


def engine_settings(service, name: str) -> dict[str, Any]:
    """What an engine of the service runs under, as vLLM resolved it (the same for both arms)."""
    import torch
    import vllm

    vc = service.engines[name].core.vllm_config
    sched, cache = vc.scheduler_config, vc.cache_config
    return {"engine": "vllm", "vllm": vllm.__version__, "torch": torch.__version__, "dtype": service.cfg.dtype,
            "block_size": cache.block_size, "kv_cache_bytes": service.cfg.kv_cache_bytes,
            "prefix_caching": bool(getattr(cache, "enable_prefix_caching", None)),
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "chunked_prefill": bool(getattr(sched, "enable_chunked_prefill", None)),
            "scheduling_policy": str(getattr(sched, "policy", "fcfs")), "enforce_eager": not service.cfg.compile,
            "selector": service.cfg.selector, "cores": len(os.sched_getaffinity(0)), "cpu": cpu_capability(),
            "store": "redis" if is_url(service.cfg.store) else "directory"}
