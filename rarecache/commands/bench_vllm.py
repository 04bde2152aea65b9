"""`rarecache bench serve / load --engine vllm`: the flags each engine takes, checked before anything
starts, and the vLLM handlers.

`bench serve` and `bench load` time our own chat service by default; with `--engine vllm` they
run the same questions on two vLLM engines loading RarecacheConnector (adapters/vllm). Some flags
belong to one engine only, and a few mean the same but default differently, so those default to
None here and `resolve` refuses the other engine's flags in one line and fills in this one's
defaults. Starting the engines takes minutes on a small CPU: every flag and the map are checked
first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..defaults import SERVED, selector_help
from ..errors import RarecacheError
from ..packages import results_path
from .common import print_json, ran_in

# what the benches write when no --out/--summary names a file: under $RARECACHE_HOME/results (packages.results_path)
SWITCH_OUT = "bench-vllm-switch.json"
LOAD_OUT = "bench-vllm-load.json"
SUMMARY = "bench-vllm-summary.json"
POISSON_OUT = "bench-load-poisson.json"

# per command and engine: the flags only that engine takes, with their defaults
SERVE = {"rarecache": {"reverse_map": None, "schedule": ["source", "target", "target"], "conversations": 3,
                       "passage_tokens": 1024, "rho": SERVED.rho, "selector": SERVED.selector, "max_new_tokens": 32},
         "vllm": {"lengths": [512, 2048, 4096], "rhos": [0.1, 0.3], "selector": SERVED.fallback, "repeats": 3,
                  "answer_tokens": 16, "max_new_tokens": 8, "block_size": 32, "cache_gib": 4.0, "store": None,
                  "summary": None, "no_summary": False, "store_gib": None, "store_ttl": None}}
POISSON = {"source": None, "target": None, "map": None, "loads": [0.25, 0.5, 0.75, 0.98], "requests": 40,
           "discard": 5, "prompt_tokens": 256, "answer_tokens": 16, "max_new_tokens": 1, "rho": SERVED.rho,
           "selector": SERVED.fallback, "max_batch": 8, "saturation_batches": 3, "seed": 0}
LOAD = {"rarecache": {"model": "qwen2.5-coder-1.5b-instruct", "clients": 4, "requests": 2, "prompt_tokens": 128,
                      "max_new_tokens": 32},
        "poisson": dict(POISSON),  # --engine rarecache --poisson: the same experiment on our own server
        "vllm": {**POISSON, "block_size": 32, "cache_gib": 4.0, "store": None, "summary": None,
                 "no_summary": False, "store_gib": None, "store_ttl": None}}
WHERE = {"rarecache": "--engine rarecache", "poisson": "--poisson", "vllm": "--engine vllm"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolve(args: argparse.Namespace, table: dict[str, dict], mode: str | None = None) -> None:
    """Refuse a flag of another mode (an engine, or --poisson); fill in this mode's defaults."""
    mode = mode or args.engine
    mine = table[mode]
    for dest in dict.fromkeys(d for flags in table.values() for d in flags):
        if dest not in mine and getattr(args, dest) not in (None, False):
            modes = " or ".join(WHERE[m] for m, flags in table.items() if dest in flags)
            raise RarecacheError(f"{_flag(dest)}: only with {modes}")
    for dest, default in mine.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def _common(g) -> None:
    g.add_argument("--block-size", type=int, default=None,
                   help="vLLM's block size (default: 32; CPU: a multiple of 32)")
    g.add_argument("--cache-gib", type=float, default=None, help="paged caches, split between the engines (default: 4)")
    g.add_argument("--store", default=None, help="row store: a directory or redis://HOST:PORT/DB "
                                                 "(default: a fresh directory under /dev/shm, removed)")
    g.add_argument("--store-gib", type=float, default=None, help="cap a directory store (LRU beyond it)")
    g.add_argument("--store-ttl", type=float, default=None, help="seconds a stored entry lives")
    g.add_argument("--summary", type=Path, default=None,
                   help=f"update this bench's keys here (default: $RARECACHE_HOME/results/{SUMMARY})")
    g.add_argument("--no-summary", action="store_true", help="do not touch the summary file")


def add_serve_options(b) -> None:
    g = b.add_argument_group("with --engine vllm")
    g.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="prompt lengths T of the switched turn (default: 512 2048 4096)")
    g.add_argument("--rhos", type=float, nargs="+", default=None, help="default: 0.1 0.3")
    g.add_argument("--repeats", type=int, default=None, help="timed runs of each arm, interleaved (default: 3)")
    g.add_argument("--answer-tokens", type=int, default=None, help="the source's first answer (default: 16)")
    _common(g)


def add_load_options(b) -> None:
    g = b.add_argument_group("with --engine vllm or --poisson (the RaReCache paper's serving experiment, §4.6)")
    g.add_argument("--poisson", action="store_true",
                   help="with --engine rarecache: the serving experiment on our own server (the target alone vs "
                        f"with handoffs, one ChatService); writes $RARECACHE_HOME/results/{POISSON_OUT} (or --out)")
    g.add_argument("--source", default=None, help="model whose rows are handed off (name or checkpoint dir)")
    g.add_argument("--target", default=None, help="model that serves the load")
    g.add_argument("--map", type=Path, default=None, help="map fitted source -> target")
    g.add_argument("--loads", type=float, nargs="+", default=None,
                   help="offered loads, λ over the target's measured saturation rate (default: 0.25 0.5 0.75 0.98)")
    g.add_argument("--discard", type=int, default=None, help="first arrivals not counted (default: 5)")
    g.add_argument("--answer-tokens", type=int, default=None, help="the source's first answer (default: 16)")
    g.add_argument("--rho", type=float, default=None, help=f"default: {SERVED.rho:g}, the served default")
    g.add_argument("--selector", default=None, help=selector_help(vllm=True))
    g.add_argument("--max-batch", type=int, default=None,
                   help="vLLM's max_num_seqs per engine, or our service's max_batch (default: 8)")
    g.add_argument("--saturation-batches", type=int, default=None,
                   help="full batches queued at once to measure saturation (default: 3, as the paper)")
    g.add_argument("--seed", type=int, default=None, help="of the Poisson trace (default: 0)")
    _common(g)


def _engine_kwargs(args) -> dict:
    from ..adapters.vllm.server.launch import check_store_flags

    if not args.cache_gib > 0:
        raise RarecacheError(f"--cache-gib must be > 0, not {args.cache_gib}")
    check_store_flags(args.store, args.store_gib, args.store_ttl)
    return {"dtype": args.dtype, "cache_dir": args.cache_dir, "block_size": args.block_size,
            "kv_cache_bytes": int(args.cache_gib * (1 << 30)) // 2, "selector": args.selector, "store": args.store,
            "store_gib": args.store_gib, "store_ttl": args.store_ttl}


def _load_map(path: Path):
    from ..transfer.mapper import Mapper

    if not Path(path).is_file():
        raise RarecacheError(f"no map file {path}")
    return Mapper.load(path)  # its calibration documents are kept out of the passages


def cmd_bench_serve_vllm(args) -> int:
    from ..bench.handoffbench import read_summary
    from ..bench.serve import VllmSwitchConfig, run_vllm_switch_bench, summary_group, switch_summary, update_summary

    cfg = VllmSwitchConfig(lengths=tuple(args.lengths), rhos=tuple(args.rhos), repeats=args.repeats,
                           answer_tokens=args.answer_tokens, max_new_tokens=args.max_new_tokens, corpus=args.corpus)
    kw = _engine_kwargs(args)
    mapper = _load_map(args.map)
    from ..adapters.vllm.server.launch import bench_service

    with bench_service(args.source, args.target, args.map, **kw) as (svc, names, settings):
        result = run_vllm_switch_bench(svc, *names, cfg, [mapper], settings, args.cache_dir,
                                       emit=lambda line: print(line, flush=True))
    if not args.no_summary:
        args.summary = args.summary or results_path(SUMMARY, args.cache_dir)
        keys = switch_summary(result, read_summary(args.summary))
        update_summary(args.summary, keys, summary_group(result), keys.pop("settings"))
        print(f"summary updated: {args.summary}", file=sys.stderr)
    print_json(result, args.out or results_path(SWITCH_OUT, args.cache_dir), indent=1)
    return 0


def _poisson_config(args):
    from ..bench.load import PoissonConfig
    from ..bench.serve import check_lengths

    if not (args.source and args.target and args.map):
        raise RarecacheError(f"bench load {'--engine vllm' if args.engine == 'vllm' else '--poisson'} needs "
                             "--source, --target and --map")
    cfg = PoissonConfig(loads=tuple(args.loads), requests=args.requests, discard=args.discard,
                        prompt_tokens=args.prompt_tokens, answer_tokens=args.answer_tokens,
                        max_new_tokens=args.max_new_tokens, rho=args.rho, saturation_batches=args.saturation_batches,
                        seed=args.seed, corpus=args.corpus)
    check_lengths([args.prompt_tokens], "--prompt-tokens")
    if args.max_batch < 1:
        raise RarecacheError(f"--max-batch must be >= 1, not {args.max_batch}")
    return cfg


def cmd_bench_load_poisson(args) -> int:
    """The paper's serving experiment on our own ChatService: the same driver as inside vLLM."""
    import torch

    from ..bench.load import ServiceArms, load_summary, run_poisson_bench
    from ..engine.llm import LLM
    from ..serve.names import model_id
    from ..serve.service import ChatService, ServiceConfig
    from ..transfer.handoff import HandoffConfig

    cfg = _poisson_config(args)
    handoff = HandoffConfig.named(args.rho, args.selector)  # refuses a selector it does not know
    mapper = _load_map(args.map)
    names = model_id(args.source), model_id(args.target)
    models = {n: LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for n, m in zip(names, (args.source, args.target))}
    cfg = ServiceConfig(handoff, max_batch=args.max_batch, max_new_tokens=max(args.max_new_tokens, args.answer_tokens),
                        min_handoff_tokens=0)  # (it times every handoff, whatever its length)
    svc = ChatService(models, {names: mapper}, cfg)
    settings = {"engine": "rarecache", **ran_in(args), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "selector": args.selector, "scheduling_policy": "fcfs"}
    try:
        result = run_poisson_bench(ServiceArms(svc), *names, cfg, [mapper], settings, args.cache_dir,
                                   emit=lambda line: print(line, flush=True), engine="rarecache")
    finally:
        svc.close()
    result["summary"] = load_summary(result)
    print_json(result, args.out or results_path(POISSON_OUT, args.cache_dir), indent=1)
    return 0


def cmd_bench_load_vllm(args) -> int:
    from ..bench.load import load_summary, run_vllm_load_bench
    from ..bench.serve import update_summary

    cfg = _poisson_config(args)
    kw = _engine_kwargs(args)
    mapper = _load_map(args.map)
    from ..adapters.vllm.server.launch import bench_service

    with bench_service(args.source, args.target, args.map, max_batch=args.max_batch, **kw) as (svc, names, settings):
        result = run_vllm_load_bench(svc, *names, cfg, [mapper], settings, args.cache_dir,
                                     emit=lambda line: print(line, flush=True))
    if not args.no_summary:
        args.summary = args.summary or results_path(SUMMARY, args.cache_dir)
        update_summary(args.summary, load_summary(result), "load",
                       {**result["settings"], "ttft_ratios_at_load": result["ttft_ratios_at_load"]})
        print(f"summary updated: {args.summary}", file=sys.stderr)
    print_json(result, args.out or results_path(LOAD_OUT, args.cache_dir), indent=1)
    return 0


def add_store_soak(bench) -> None:
    from .common import add_model_options, vllm_device

    b = bench.add_parser("store-soak", help="the vLLM row store capped small under switching traffic (counts)",
                         description="Start both models in vLLM engines on a small row store (--store-gib, or a Redis "
                                     "server with maxmemory), send multi-turn conversations that switch model every "
                                     "turn for --duration seconds, and check that the store never grows past its "
                                     "cap, that no request fails, that rows were evicted and that memory stays flat. "
                                     "Writes store_cap_bytes, store_bytes_max, failed, evictions, rss_growth to "
                                     "--out; exit 1 if a check fails.")
    b.add_argument("--source", required=True, help="model whose rows are handed off (name or checkpoint dir)")
    b.add_argument("--target", required=True, help="the other model")
    b.add_argument("--map", type=Path, required=True, help="map fitted source -> target")
    b.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default: 1800)")
    b.add_argument("--conversations", type=int, default=8, help="tenants in flight, round robin (default: 8)")
    b.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer (default: 16)")
    b.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="a conversation past this starts again under a new tenant (default: 1024)")
    b.add_argument("--selector", default=SERVED.fallback, help=selector_help(vllm=True))
    b.add_argument("--block-size", type=int, default=32, help="vLLM's block size (default: 32)")
    b.add_argument("--cache-gib", type=float, default=4.0, help="paged caches, split between the engines (default: 4)")
    b.add_argument("--store", default=None, help="a directory or redis://HOST:PORT/DB (default: a fresh directory)")
    b.add_argument("--store-gib", type=float, default=0.05, help="cap of a directory store (default: 0.05)")
    b.add_argument("--store-ttl", type=float, default=None, help="seconds a stored entry lives")
    b.add_argument("--out", type=Path, default=None, help="write the JSON here")
    add_model_options(b, device=vllm_device)
    b.set_defaults(func=cmd_bench_store_soak)


def cmd_bench_store_soak(args) -> int:
    from ..adapters.vllm.server.launch import bench_service, check_store_flags
    from ..adapters.vllm.rowstore.interface import is_url
    from ..bench.store_soak import StoreSoakConfig, run_store_soak

    gib = None if args.store is not None and is_url(args.store) else args.store_gib
    check_store_flags(args.store, gib, args.store_ttl)
    cfg = StoreSoakConfig(duration_s=args.duration, conversations=args.conversations,
                          max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)
    with bench_service(args.source, args.target, args.map, dtype=args.dtype, cache_dir=args.cache_dir,
                       block_size=args.block_size, kv_cache_bytes=int(args.cache_gib * (1 << 30)) // 2,
                       selector=args.selector, store=args.store, store_gib=gib, store_ttl=args.store_ttl) as (
            svc, names, settings):
        result = run_store_soak(svc, names, cfg, emit=lambda line: print(line, flush=True))
    result["settings"] = settings
    print_json(result, args.out, indent=1)
    return 0 if result["ok"] else 1
