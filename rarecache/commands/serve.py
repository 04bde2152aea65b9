"""`rarecache serve` (the OpenAI-compatible chat server) and `rarecache demo` (the bundled pair end to end)."""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

from ..defaults import MIN_HANDOFF_TOKENS, SERVED, selector_help
from ..errors import RarecacheError
from .common import add_model_options, engine_device, fill_served_defaults


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="the bundled pair end to end through the shipped map: hand off, time, compare",
                       description="Pull Qwen2.5-Coder 0.5B and 1.5B if needed, load the general map rarecache ships "
                                   "(the map, selector and budget `serve` uses; nothing is calibrated), hand fixed "
                                   "prompts from 0.5B to 1.5B at rho 0, the served budget and 1, and print the "
                                   "answers, the speed-up over the 1.5B's own prefill timed in the same run and the "
                                   "agreement of the greedy tokens with the 1.5B's own.")
    p.add_argument("--rhos", type=float, nargs="+", default=[0.0, SERVED.rho, 1.0],
                   help=f"default: 0 {SERVED.rho:g} 1 (the served budget in the middle)")
    p.add_argument("--selector", default=SERVED.selector, help=selector_help())
    p.add_argument("--tokens", type=int, default=16384,
                   help="calibration tokens of a quick map, made only if the shipped map does not fit the models "
                        "as converted here (default: 16384)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="default: 24")
    add_model_options(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from ..demo import DemoConfig, run_demo

    return run_demo(DemoConfig(rhos=tuple(args.rhos), selector=args.selector, tokens=args.tokens,
                               max_new_tokens=args.max_new_tokens, dtype=args.dtype, cache_dir=args.cache_dir))


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible chat server; conversations move between the models by handoff",
                       description="Serve both models behind POST /v1/chat/completions (model = either name). "
                                   "The server keeps recent caches of both models; when a request goes to a model "
                                   "and the other one holds a longer prefix of the conversation, that cache is "
                                   "mapped and the selected positions recomputed instead of re-reading the prompt. "
                                   "Running answers are decoded together in one batched step (--max-batch); "
                                   "GET /v1/models lists the names, GET /health the load and held cache size, "
                                   "GET /metrics Prometheus metrics (handoffs, fallbacks by reason, store, TTFT).")
    p.add_argument("--source", default=SERVED.source,
                   help=f"model whose cache is mapped (default: the bundled {SERVED.source})")
    p.add_argument("--target", default=SERVED.target,
                   help=f"model that receives it (default: the bundled {SERVED.target})")
    p.add_argument("--map", type=Path, default=None,
                   help="map fitted source -> target (default for the bundled pair: its general map, from "
                        "`rarecache calibrate --preset general --source S --target T` if it has been made, else the "
                        "one rarecache ships)")
    p.add_argument("--reverse-map", type=Path, default=None, help="map fitted target -> source, to hand back too")
    p.add_argument("--rho", default=None,
                   help=f"share of handed-off positions recomputed (default: {SERVED.rho:g}, the served default), "
                        "or auto: the quality gate "
                        "picks it per request and falls back to the model's own prefill (--gate-policy)")
    p.add_argument("--gate-policy", type=Path, default=None,
                   help="with --rho auto: the policy file (`rarecache eval gate fit`), fitted through the map "
                        "served here; its selector replaces --selector (--engine vllm: a policy on nll climbing one "
                        "rung with suffix, or one that always falls back)")
    p.add_argument("--max-loss", type=float, default=None, metavar="SHARE",
                   help="with --rho auto: the loss the gate may accept, as the share of changed answers (or, for "
                        "a policy fitted with --loss accuracy, the accuracy lost) on the policy's held-apart "
                        "multiple-choice items (its bpb bound scales with it); picks the policy file's fitted "
                        "level at most SHARE (default: the level it was fitted at)")
    p.add_argument("--selector", default=None, help=selector_help())
    p.add_argument("--no-request-budget", dest="request_budget", action="store_false",
                   help="refuse a request naming a budget other than the server's (its body's rarecache.rho and "
                        "selector); by default a request may name its own, e.g. {\"rho\": 1} for the model's own "
                        "rows (README: threat model)")
    p.add_argument("--min-handoff-tokens", type=int, default=MIN_HANDOFF_TOKENS, metavar="N",
                   help=f"prompts of fewer tokens are read by the model itself, never handed off (the response "
                        f"says fallback_reprefill, reason short_prompt; default: {MIN_HANDOFF_TOKENS}; 0 hands off "
                        "at any length)")
    p.add_argument("--heal", action="store_true",
                   help="when idle, re-prefill the rows a handoff left (256 positions a step), so a conversation's "
                        "later turns reuse the model's own rows and a handoff costs accuracy on its own turn only")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (local only)")
    p.add_argument("--api-key", default=None,
                   help="clients must send Authorization: Bearer KEY (every route but /health; default: "
                        "$RARECACHE_API_KEY, else none); see the README's threat model")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--openapi-docs", action="store_true",
                   help="also serve FastAPI's /docs, /redoc and /openapi.json (default: off; behind --api-key "
                        "like every route but /health)")
    p.add_argument("--cache-gib", type=float, default=4.0, help="memory for held caches, both models (default: 4)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the most max_tokens a request may ask (1024)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives none (default: 256)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="answers decoded together in one batched step (default: 8)")
    p.add_argument("--max-waiting", type=int, default=16,
                   help="requests that may queue past --max-batch running ones; more get a 503 (default: 16)")
    p.add_argument("--engine", choices=["rarecache", "vllm"], default="rarecache",
                   help="rarecache: our own runner (default); vllm: each model in a vLLM engine with "
                        "RarecacheConnector (the vllm extra; docs/VLLM.md), --cache-gib split between them")
    p.add_argument("--accept-poor-map", action="store_true",
                   help="serve a map that fits badly (held-out R2 below 0.2 or far below in-sample: `rarecache "
                        "inspect` says), which is refused otherwise")
    v = p.add_argument_group("with --engine vllm")
    v.add_argument("--store", default=None,
                   help="row store the engines share: a directory, or a Redis server redis://HOST:PORT/DB or "
                        "unix:///path.sock that engines on other hosts share too (default: a fresh directory "
                        "under /dev/shm, removed at exit)")
    v.add_argument("--store-gib", type=float, default=None,
                   help="cap a directory store at this size, evicting the least recently used rows (default: none; "
                        "a Redis store is bounded by the server's maxmemory)")
    v.add_argument("--store-ttl", type=float, default=None,
                   help="seconds a stored entry lives (default: until evicted)")
    v.add_argument("--block-size", type=int, default=None,
                   help="vLLM's block size; a handoff claims whole blocks (default: vLLM's; CPU: a multiple of 32)")
    v.add_argument("--max-model-len", type=int, default=None, help="vLLM's max_model_len (default: the model's)")
    v.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks per engine (default: 1); the connector writes each rank's KV heads, and the "
                        "recompute runs on every rank over its shards (on a CPU the cores are split between them)")
    v.add_argument("--compile", action="store_true",
                   help="let vLLM compile the model (torch.compile, CUDA graphs); default eager, the tested path")
    add_model_options(p, device=engine_device)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as e:
        raise RarecacheError(f"rarecache serve needs FastAPI and uvicorn ({e.name} is missing): "
                             "pip install 'rarecache[serve]'") from None
    from ..serve.names import model_id

    api_key = _check_flags(args)
    runs = None
    if args.engine == "vllm":
        from ..adapters.vllm.connector.core import ENGINE_SELECTORS  # engine-free module
        runs = ENGINE_SELECTORS
    gated = args.rho == "auto"  # (the gate policy names its own selector)
    for kind, note in fill_served_defaults(args, args.source, args.target, runs).items():
        if not (gated and kind == "selector"):
            print(note, file=sys.stderr)
    rho, gate = _rho(args)
    args.rho = rho  # a number from here on (None with the gate)
    names = model_id(args.source), model_id(args.target)
    if names[0] == names[1]:
        raise RarecacheError(f"source and target would both be served as {names[0]!r}")
    if args.engine == "vllm":
        if args.heal:
            raise RarecacheError("--heal runs in our own engine only, not --engine vllm")
        from ..adapters.vllm.server.launch import serve_vllm

        return serve_vllm(args, names, api_key, gate)  # (the gate's shape is checked there: server/vllm_gate.py)
    service = _our_service(args, names, rho, gate)
    budget = (f"gate {gate.selector}, rungs {'/'.join(f'{r:g}' for r in gate.climbed)}, threshold {gate.threshold:.4g}"
              if gate else f"rho {rho:g}, {args.selector}")
    print(f"serving {' and '.join(names)} (handoff {', '.join(f'{a} -> {b}' for a, b in service.maps)}, {budget}; "
          f"prompts under {args.min_handoff_tokens} tokens re-prefilled) on "
          f"http://{args.host}:{args.port}/v1/chat/completions", file=sys.stderr)
    app = create_app(service, default_max_tokens=args.default_max_tokens, max_waiting=args.max_waiting,
                     api_key=api_key, openapi_docs=args.openapi_docs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _check_flags(args) -> str | None:
    """The flags every engine shares, checked before anything loads; the API key in force."""
    if not 1 <= args.port <= 65535:
        raise RarecacheError(f"--port must be in 1..65535, got {args.port}")
    if (args.cache_gib <= 0 or args.max_waiting < 0 or args.max_batch < 1 or args.min_handoff_tokens < 0
            or not 1 <= args.default_max_tokens <= args.max_tokens_limit):
        raise RarecacheError("--cache-gib must be > 0, --max-batch >= 1, --max-waiting >= 0, --min-handoff-tokens "
                             ">= 0 and 1 <= --default-max-tokens <= --max-tokens-limit")
    api_key = args.api_key if args.api_key is not None else os.environ.get("RARECACHE_API_KEY")
    if api_key is not None and not api_key.strip():
        raise RarecacheError("--api-key (or $RARECACHE_API_KEY) is empty")
    if api_key is None and not _loopback(args.host):
        print(f"rarecache: warning: serving on {args.host} without an API key: anyone who can reach the port can "
              "use the models; pass --api-key (or set RARECACHE_API_KEY)", file=sys.stderr)
    if args.map is None and (args.source, args.target) != (SERVED.source, SERVED.target):
        raise RarecacheError("give --map: without it only the bundled pair is served (with its general map)")
    if args.engine != "vllm":
        given = [flag for flag, value in (("--store", args.store), ("--store-gib", args.store_gib),
                                          ("--store-ttl", args.store_ttl), ("--block-size", args.block_size),
                                          ("--max-model-len", args.max_model_len), ("--compile", args.compile),
                                          ("--tensor-parallel-size", None if args.tensor_parallel_size == 1 else 1))
                 if value not in (None, False)]
        if given:
            raise RarecacheError(f"{', '.join(given)}: only with --engine vllm")
    return api_key


def _our_service(args, names: tuple[str, str], rho: float | None, gate):
    """Our own engine's service. Map files load (and fail) before the models, which take much longer; the
    bundled pair's shipped map gives way to the quick map where it does not fit the models as converted here
    (`demo.served_or_quick_map`, the rule `demo` follows too)."""
    from ..demo import DemoConfig, served_or_quick_map
    from ..engine.llm import LLM
    from ..packages import sha256_file
    from ..serve.service import ChatService, ServiceConfig
    from ..transfer.mapper import Mapper

    cfg = ServiceConfig.started(rho, args.selector, gate, cache_bytes=int(args.cache_gib * (1 << 30)),
                                max_new_tokens=args.max_tokens_limit, max_batch=args.max_batch,
                                request_budget=args.request_budget, heal=args.heal,
                                min_handoff_tokens=args.min_handoff_tokens)
    maps, files = {}, {}
    for pair, path in ((names, args.map), (names[::-1], args.reverse_map)):
        if path is not None:
            maps[pair], files[pair] = Mapper.load(path), path
            maps[pair].check_fit(args.accept_poor_map, f"the map {path}")
    models = {names[0]: LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir),
              names[1]: LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir)}
    if args.map == SERVED.path:  # the committed map is for the pair as the recorded environment converted it
        maps[names], files[names], _ = served_or_quick_map(DemoConfig(dtype=args.dtype, cache_dir=args.cache_dir),
                                                           *models.values(), shipped=maps[names])
    return ChatService(models, maps, cfg, {pair: sha256_file(path) for pair, path in files.items()})


def _rho(args):
    """--rho NUMBER, or auto with --gate-policy: (rho, None) or (None, the policy), checked before models load.
    A policy is tied to the map it was fitted through (its threshold is in the handed-off model's output)."""
    from ..transfer.gate.policy import GatePolicy

    if args.rho != "auto":
        if args.gate_policy is not None or args.max_loss is not None:
            raise RarecacheError("--gate-policy and --max-loss go with --rho auto")
        try:
            return float(args.rho), None
        except ValueError:
            raise RarecacheError(f"--rho must be a number in [0, 1] or auto, got {args.rho!r}") from None
    if args.gate_policy is None:
        raise RarecacheError("--rho auto needs --gate-policy FILE (from `rarecache eval gate fit`)")
    if args.map is None:
        raise RarecacheError("--rho auto needs --map: the map the policy was fitted through")
    if not args.gate_policy.is_file() or not args.map.is_file():
        raise RarecacheError(f"no file {args.gate_policy if not args.gate_policy.is_file() else args.map}")
    from ..packages import sha256_file

    gate = GatePolicy.load(args.gate_policy)
    fitted = {t.get("map_sha256") for t in gate.fitted.get("tasks", {}).values()}
    if fitted != {sha256_file(args.map)}:
        raise RarecacheError(f"{args.gate_policy} was not fitted through {args.map}: its threshold holds for "
                             "the map it was fitted with only")
    if args.max_loss is not None:
        if not 0 <= args.max_loss <= 1:
            raise RarecacheError(f"--max-loss is a share of answers in [0, 1], got {args.max_loss:g}")
        gate = gate.at_loss(args.max_loss)
        b = gate.fitted["bounds"]
        print(f"gate: the level fitted at <= {b['max_changed']:g} changed answers, <= {b['max_bpb']:g} bpb "
              f"(threshold {gate.threshold:.4g} bits)", file=sys.stderr)
    return None, gate


def _loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
