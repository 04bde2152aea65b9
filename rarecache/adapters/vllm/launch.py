"""`rarecache serve --engine vllm`: check the flags, find the pair and its maps, start both engines, serve.

commands/serve.py parses the flags both engines share and hands over here. Everything a
user can get wrong is refused before the first engine starts (each takes about a minute on a
small CPU): the vLLM settings by VllmServeConfig, the maps by VllmChatService. vLLM's CPU
thread settings are given defaults that use every core (engines.engine_environment), printed
so they can be repeated or overridden. The row store is a fresh private directory unless
`--store` names one to share (with another server, or to keep); a fresh one is removed at exit.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ...errors import RarecacheError


def serve_vllm(args, names: tuple[str, str], api_key: str | None) -> int:
    try:
        import uvicorn

        from ...serve.app import create_app
    except ImportError as e:
        raise RarecacheError(f"rarecache serve needs FastAPI and uvicorn ({e.name} is missing): "
                             "pip install 'rarecache[serve]'") from None
    import torch

    from ...models.store import resolve_model
    from .engines import engine_environment
    from .serving import VllmChatService, VllmServeConfig

    fresh = args.store is None
    shm = Path("/dev/shm")
    store = Path(tempfile.mkdtemp(prefix="rarecache-rows-", dir=shm if shm.is_dir() else None)) if fresh \
        else args.store.expanduser()
    try:
        cfg = VllmServeConfig(store=store, rho=args.rho, selector=args.selector, dtype=args.dtype,
                              max_batch=args.max_batch, max_new_tokens=args.max_tokens_limit,
                              kv_cache_bytes=int(args.cache_gib * (1 << 30)) // 2, block_size=args.block_size,
                              max_model_len=args.max_model_len, compile=args.compile)
        paths = [resolve_model(m, cache_dir=args.cache_dir) for m in (args.source, args.target)]
        maps = {}
        for pair, path in (((names[0], names[1]), args.map), ((names[1], names[0]), args.reverse_map)):
            if path is not None:
                if not Path(path).is_file():
                    raise RarecacheError(f"no map file {path}")
                maps[pair] = Path(path)
        if args.map is None:  # the bundled pair: the demo's map (calibrated by our runner on first use)
            maps[(names[0], names[1])] = _demo_map(args, store)
        if not torch.cuda.is_available():
            settings = engine_environment()
            print("rarecache: vLLM CPU threads: " + " ".join(f"{k}={v}" for k, v in settings.items()),
                  file=sys.stderr)
        service = VllmChatService(dict(zip(names, paths)), maps, cfg)
        try:
            app = create_app(service, default_max_tokens=args.default_max_tokens, max_waiting=args.max_waiting,
                             api_key=api_key)
            print(f"serving {' and '.join(names)} in vLLM (handoff {', '.join(f'{a} -> {b}' for a, b in maps)}, "
                  f"rho {cfg.rho:g}, {cfg.selector}; row store {store}) on "
                  f"http://{args.host}:{args.port}/v1/chat/completions", file=sys.stderr)
            uvicorn.run(app, host=args.host, port=args.port, log_level="info")
        finally:
            service.close()
    finally:
        if fresh:
            shutil.rmtree(store, ignore_errors=True)
    return 0


def _demo_map(args, store: Path) -> Path:
    """The demo's map for the bundled pair, written where the engines can load it."""
    from ...demo import DemoConfig, demo_map
    from ...engine.llm import LLM

    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    mapper = demo_map(DemoConfig(dtype=args.dtype, cache_dir=args.cache_dir), source, target)
    del source, target
    gc.collect()  # our copies of the weights go before vLLM loads its own
    path = store / "maps" / "demo.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    mapper.save(path)
    os.chmod(path, 0o600)
    return path
