"""`rarecache bench map / handoff / serve / load / ablate`: speed, as ratios to a baseline timed in the same run;
`rarecache bench soak`: the server under overload, killed and restarted (counts, not speed);
`rarecache bench store-soak`: the vLLM row store capped small under switching traffic (bench_vllm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..defaults import SERVED, selector_help
from ..errors import RarecacheError
from ..packages import results_path
from .bench_gpu import add_gpu
from .common import (add_model_options, add_pair_options, engine_device, load_pair, print_json, ran_in, with_map_dtype,
                     write_out)

SUMMARY = "bench-handoff-summary.json"  # under $RARECACHE_HOME/results unless --summary names a file


def register(sub) -> None:
    p = sub.add_parser("bench", help="speed harness (ratios to a baseline timed in the same run)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_map(bench)
    _add_handoff(bench)
    _add_serve(bench)
    _add_load(bench)
    _add_ablate(bench)
    _add_soak(bench)
    add_gpu(bench)
    from .bench_vllm import add_store_soak

    add_store_soak(bench)


def _add_map(bench) -> None:
    b = bench.add_parser("map", help="time to map a prompt's cache vs the target's own prefill")
    add_pair_options(b)
    b.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths (default: 512 2048)")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (default: 3)")
    add_model_options(b)
    b.set_defaults(func=cmd_bench_map)


def cmd_bench_map(args) -> int:
    from ..bench.mapbench import time_map
    from ..bench.progress import round_lines, rounds, table_row

    source, target, mapper, _ = load_pair(args)
    rows = []
    print(f"map vs target prefill, {source.path.name} -> {target.path.name}, {args.dtype}, batch 1, "
          f"median of {args.repeats} after a warm-up")
    print(f"{'T':>6} {'prefill ms':>11} {'map ms':>9} {'score ms':>9} {'map/prefill':>12} {'(map+score)/prefill':>20}")
    with rounds(len(args.lengths) * (args.repeats + 1), "bench map") as bar:
        for length in args.lengths:
            r = time_map(source, target, mapper, length, args.repeats,
                         on_round=round_lines(bar, f"T {length}", args.repeats, length, "map")).row()
            rows.append(r)
            table_row(f"{r['T']:>6} {r['prefill_ms']:>11.1f} {r['map_ms']:>9.1f} {r['score_ms']:>9.1f} "
                      f"{r['map_over_prefill']:>12.3f} {r['map_score_over_prefill']:>20.3f}")
    print_json({"bench": "map", "source": source.path.name, "target": target.path.name, **ran_in(args),
                "rows": rows})
    return 0


def _add_handoff(bench) -> None:
    b = bench.add_parser("handoff", help="phase times vs the target's prefill, with the eq. 11 FLOP ceilings",
                         description="Time map, score and recompute against the target's own prefill of the same "
                                     "prompts in the same run, for every length x batch x rho; print a table, then "
                                     "one JSON line.")
    add_bench_pair_options(b)
    b.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    b.add_argument("--rhos", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    b.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    b.add_argument("--selector", default=SERVED.selector, help=selector_help() + "; suffix scores nothing")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    b.add_argument("--summary", type=Path, default=None,
                   help=f"write the per-cell summary (share of the sparse ceiling, map + score share, peak memory) "
                        f"here (default: $RARECACHE_HOME/results/{SUMMARY})")
    b.add_argument("--no-summary", action="store_true", help="do not write the summary file")
    add_pack_option(b)
    add_model_options(b)
    b.set_defaults(func=cmd_bench_handoff)


def add_bench_pair_options(b) -> None:
    """The pair a bench times: a real one (--source/--target/--map) or random weights at real shapes."""
    add_pair_options(b, required=False)
    b.add_argument("--shapes", default=None,
                   help="random weights at real shapes instead: qwen3-0.6b:qwen3-14b or llama-3.1-8b:llama-3.3-70b "
                        "(needs a GPU's memory at full depth)")
    b.add_argument("--max-layers", type=int, default=None, help="with --shapes: cut both models to N layers")
    b.add_argument("--rank", type=int, default=128, help="with --shapes: probe rank (default: 128)")
    b.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def bench_pair(args):
    """(source, target, mapper, a name for the pair) from add_bench_pair_options' flags."""
    import torch

    from ..engine.llm import DTYPES

    if args.device.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise RarecacheError(f"--device {args.device}: this machine has no CUDA GPU")
    if args.shapes:
        from ..bench.shapes import random_mapper, random_runner

        names = args.shapes.split(":")
        if len(names) != 2:
            raise RarecacheError("--shapes takes SOURCE:TARGET, e.g. qwen3-0.6b:qwen3-14b")
        source, target = (random_runner(n, DTYPES[args.dtype], args.device, args.max_layers) for n in names)
        mapper = with_map_dtype(random_mapper(source, target, rank=args.rank), args)
        return source, target, mapper, (f"{args.shapes} (random weights"
                                        f"{f', {args.max_layers} layers' if args.max_layers else ''})")
    if not (args.source and args.target and args.map):
        raise RarecacheError("give --source, --target and --map, or --shapes SOURCE:TARGET")
    source, target, mapper, _ = load_pair(args)
    return source, target, mapper, f"{source.path.name} -> {target.path.name}"


def add_pack_option(b) -> None:
    b.add_argument("--pack", action="store_true",
                   help="prepack the target's float32 weights for oneDNN (faster small products, float32-close "
                        "to F.linear; bfloat16 packs by default where the CPU can)")


def cmd_bench_handoff(args) -> int:
    import torch

    from ..bench.handoffbench import read_summary, summary, time_cell
    from ..bench.progress import round_lines, rounds, table_row
    from ..bench.memory import formula, memory_kind
    from ..transfer.selectors import SELECTORS

    if args.selector not in SELECTORS:
        raise RarecacheError(f"unknown selector {args.selector!r}; known: {', '.join(SELECTORS)}")
    source, target, mapper, pair = bench_pair(args)
    if args.pack:
        _pack(target)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    map_dtype = str(mapper.dtype_for(target)).removeprefix("torch.")
    cpu = torch.backends.cpu.get_cpu_capability() if args.device == "cpu" else None  # which kernels ran
    print(f"handoff vs target prefill: {pair}, {args.dtype}{', packed' if target.packed else ''}, map in {map_dtype}, "
          f"{args.device}{f' ({cpu})' if cpu else ''}, threads {threads}, selector {args.selector}, "
          f"median of {args.repeats} after a warm-up; source prefill not counted; the rank score runs inside the "
          f"map phase")
    print(f"memory ({memory_kind(args.device)}, MiB above the weights): {formula(source, target, mapper)}")
    head = (f"{'T':>5} {'rho':>4} {'B':>3} {'prefill ms':>10} {'map':>7} {'score':>6} {'recomp':>8} "
            f"{'handoff':>8} {'speedup':>7} {'ceil dense':>10} {'ceil sparse':>11} {'of sparse':>9} {'map+score':>9} "
            f"{'mem pre':>8} {'mem hand':>8} {'(src':>6} {'tgt':>6} {'map)':>5}")
    print(head)
    rows, cells = [], [(T, b, rho) for T in args.lengths for b in args.batches for rho in args.rhos]
    with rounds(len(cells) * (args.repeats + 1), "bench handoff") as bar:
        for T, batch, rho in cells:
            report = round_lines(bar, f"T {T} rho {rho} B {batch}", args.repeats, T * batch, "handoff")
            r = time_cell(source, target, mapper, T, rho, batch, args.repeats, selector=args.selector,
                          on_round=report).row(target, mapper)
            rows.append(r)
            table_row(f"{T:>5} {rho:>4} {batch:>3} {r['prefill_ms']:>10.1f} {r['map_ms']:>7.1f} {r['score_ms']:>6.1f} "
                      f"{r['recompute_ms']:>8.1f} {r['handoff_ms']:>8.1f} {r['speedup']:>6.2f}x "
                      f"{r['ceiling_dense']:>9.2f}x {r['ceiling_sparse']:>10.2f}x {r['of_sparse_ceiling']:>9.2f} "
                      f"{r['map_score_share_of_prefill']:>8.1%} {_mib(r['peak_mem_prefill_mib']):>8} "
                      f"{_mib(r['peak_mem_handoff_mib']):>8} {r['source_cache_mib']:>6.0f} {r['target_cache_mib']:>6.0f} "
                      f"{r['map_mib']:>5.0f}")
            if "pass1_ms" in r:  # a two-pass selector: its recompute is both passes
                refined = f" + refining pass {r['refine_ms']:.1f} ms" if "refine_ms" in r else ""
                table_row(f"{'':>14} recompute = pass 1 {r['pass1_ms']:.1f} ms{refined} "
                          f"+ pass 2 {r['pass2_ms']:.1f} ms")
    header = {"bench": "handoff", "pair": pair, "selector": args.selector, "dtype": args.dtype, "map_dtype": map_dtype,
              "packed": target.packed, "device": args.device, "cpu": cpu, "threads": threads,
              "memory": memory_kind(args.device)}
    if not args.no_summary:
        args.summary = args.summary or results_path(SUMMARY, args.cache_dir)
        written = summary(rows, read_summary(args.summary), **header)
        write_out(args.summary, json.dumps(written, indent=1) + "\n")
        kept = len(written["rows"]) - len(rows)
        print(f"summary written to {args.summary}" + (f" ({kept} cells of an earlier run of the same setup kept)"
                                                       if kept else ""))
    print_json({**header, "rows": rows}, args.out, indent=1)
    return 0


def _pack(runner) -> None:
    try:
        runner.pack()
    except ValueError as e:
        raise RarecacheError(f"--pack: {e}") from None


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _add_serve(bench) -> None:
    from .bench_vllm import add_serve_options

    b = bench.add_parser("serve", help="time to first token when a conversation switches model: handoff vs "
                                       "re-reading, through the chat service or inside vLLM",
                         description="Scripted multi-turn conversations over held-out corpus passages, answered "
                                     "turn by turn by the models the schedule names, twice in the same run: through "
                                     "a service that hands off between the models and through one that re-reads. "
                                     "Prints a row per turn, the median speed-up on switched turns, then one JSON line. "
                                     "With --engine vllm: a switched turn of T tokens on two vLLM engines, the "
                                     "connector's handoff at each rho vs vLLM reading the whole prompt itself, "
                                     "interleaved, medians; writes the JSON (--out) and the summary's switch keys "
                                     "(--summary), by default under $RARECACHE_HOME/results.")
    add_pair_options(b)
    b.add_argument("--engine", choices=["rarecache", "vllm"], default="rarecache",
                   help="rarecache: our chat service (default); vllm: two vLLM engines with RarecacheConnector")
    b.add_argument("--reverse-map", type=Path, default=None, help="map fitted target -> source, to hand back too")
    b.add_argument("--schedule", nargs="+", default=None, choices=["source", "target"],
                   help="who answers each turn (default: source target target)")
    b.add_argument("--conversations", type=int, default=None, help="default: 3")
    b.add_argument("--passage-tokens", type=int, default=None, help="passage length in the first turn (default: 1024)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="default: 32; with --engine vllm: 8")
    b.add_argument("--corpus", default="wiki", help="passages from this corpus's unused documents (default: wiki)")
    b.add_argument("--rho", type=float, default=None, help=f"default: {SERVED.rho:g} (--engine vllm: --rhos)")
    b.add_argument("--selector", default=None, help=selector_help())
    b.add_argument("--out", type=Path, default=None,
                   help="also write the JSON here (--engine vllm: default $RARECACHE_HOME/results/"
                        "bench-vllm-switch.json)")
    add_serve_options(b)
    add_model_options(b, device=engine_device)
    b.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from .bench_vllm import SERVE, cmd_bench_serve_vllm, resolve

    resolve(args, SERVE)
    if args.engine == "vllm":
        return cmd_bench_serve_vllm(args)
    from ..bench.serve import SwitchBenchConfig, run_switch_bench
    from ..engine.llm import LLM
    from ..transfer.handoff import HandoffConfig
    from ..transfer.mapper import Mapper

    cfg = SwitchBenchConfig(conversations=args.conversations, passage_tokens=args.passage_tokens,
                            schedule=tuple(args.schedule), max_new_tokens=args.max_new_tokens, corpus=args.corpus,
                            handoff=HandoffConfig.named(args.rho, args.selector))
    back = any(a == "target" and b == "source" for a, b in zip(cfg.schedule, cfg.schedule[1:]))
    if back and args.reverse_map is None:
        print("no --reverse-map: turns back to the source re-read what it has not seen", file=sys.stderr)
    forward = Mapper.load(args.map)  # before the models, which take much longer to load
    backward = Mapper.load(args.reverse_map) if args.reverse_map else None
    source = LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir)
    target = LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir)
    print_json({**run_switch_bench(source, target, forward, backward, cfg, args.cache_dir), **ran_in(args)}, args.out)
    return 0


def _add_load(bench) -> None:
    from .bench_vllm import add_load_options

    b = bench.add_parser("load", help="throughput of the chat service under concurrent clients: batched "
                                      "decoding vs one request at a time; with --engine vllm or --poisson, Poisson load",
                         description="A load generator: CLIENTS threads each send REQUESTS chat requests back to "
                                     "back (a held-out corpus passage and a question) to one model through the "
                                     "chat service, once with one answer decoded at a time and once with up to "
                                     "CLIENTS decoded together, in the same run. Prints tokens/s and latencies per "
                                     "arm, the throughput ratio and how many answers agree, then one JSON line. "
                                     "With --engine vllm: switched conversations arriving as a Poisson process at "
                                     "each offered load (over the target's measured saturation rate), vLLM alone vs "
                                     "vLLM + handoff under the same traces: TTFT p50/p99 and throughput; writes "
                                     "$RARECACHE_HOME/results/bench-vllm-load.json (or --out) and the summary's "
                                     "saturation keys. With --poisson (our own server): the same experiment on one "
                                     "ChatService, target alone vs with handoffs; writes "
                                     "$RARECACHE_HOME/results/bench-load-poisson.json (or --out).")
    b.add_argument("--engine", choices=["rarecache", "vllm"], default="rarecache",
                   help="rarecache: our chat service (default); vllm: two vLLM engines with RarecacheConnector")
    b.add_argument("--model", default=None, help="model to load (default: the bundled qwen2.5-coder-1.5b-instruct)")
    b.add_argument("--clients", type=int, default=None,
                   help="concurrent clients = the batched arm's max batch (default: 4)")
    b.add_argument("--requests", type=int, default=None,
                   help="requests per client, back to back (default: 2); --engine vllm: per load and arm (40)")
    b.add_argument("--prompt-tokens", type=int, default=None,
                   help="passage tokens per request (default: 128); --engine vllm: the switched prompt (256)")
    b.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per answer, no early end (default: 32; --engine vllm: 1)")
    b.add_argument("--corpus", default="wiki", help="passages from this corpus (default: wiki)")
    b.add_argument("--out", type=Path, default=None,
                   help="also write the JSON here (--engine vllm: default $RARECACHE_HOME/results/"
                        "bench-vllm-load.json)")
    add_load_options(b)
    add_model_options(b, device=engine_device)
    b.set_defaults(func=cmd_bench_load)


def cmd_bench_load(args) -> int:
    from .bench_vllm import LOAD, cmd_bench_load_poisson, cmd_bench_load_vllm, resolve

    if args.poisson and args.engine == "vllm":
        raise RarecacheError("--poisson is for --engine rarecache (with --engine vllm the bench is always it)")
    resolve(args, LOAD, "poisson" if args.poisson else None)
    if args.engine == "vllm":
        return cmd_bench_load_vllm(args)
    if args.poisson:
        return cmd_bench_load_poisson(args)
    from ..bench.load import LoadBenchConfig, run_load_bench
    from ..engine.llm import LLM

    cfg = LoadBenchConfig(clients=args.clients, requests=args.requests, prompt_tokens=args.prompt_tokens,
                          max_new_tokens=args.max_new_tokens, corpus=args.corpus)
    llm = LLM(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    print_json({**run_load_bench(llm, cfg, args.cache_dir), **ran_in(args)}, args.out)
    return 0


def _add_ablate(bench) -> None:
    b = bench.add_parser("ablate", help="each optimisation vs the reference it replaces, in the same run")
    add_bench_pair_options(b)
    b.add_argument("--length", type=int, default=2048, help="prompt length (default: 2048)")
    b.add_argument("--rho", type=float, default=SERVED.rho, help=f"default: {SERVED.rho:g}, the served default")
    b.add_argument("--batch", type=int, default=4, help="requests in the batching comparison (default: 4)")
    b.add_argument("--repeats", type=int, default=3)
    add_pack_option(b)
    add_model_options(b)
    b.set_defaults(func=cmd_bench_ablate)


def cmd_bench_ablate(args) -> int:
    from ..bench.ablate import ablate

    source, target, mapper, pair = bench_pair(args)
    if args.pack and not target.packed:
        from ..models.packed import pack_float32

        if not pack_float32(target.dtype, target.device):
            _pack(target)  # refused with the reason (the float32 rows pack it in place after timing it plain)
    print(f"optimisations vs their references: {pair}, T={args.length}, rho={args.rho}, {args.dtype}, "
          f"{args.device}, median of {args.repeats} after a warm-up")
    print(f"{'optimisation':66s} {'before ms':>10} {'after ms':>10} {'gain':>6}", flush=True)
    rows = ablate(source, target, mapper, args.length, args.rho, args.batch, args.repeats, pack=args.pack,
                  on_row=lambda r: print(f"{r['optimisation']:66s} {r['before_ms']:>10.1f} {r['after_ms']:>10.1f} "
                                         f"{r['gain']:>5.2f}x", flush=True))  # each row as it is measured
    print_json({"bench": "ablate", "pair": pair, "device": args.device, "T": args.length, "rho": args.rho,
                **ran_in(args), "packed": target.packed,
                "rows": rows})
    return 0


def _add_soak(bench) -> None:
    b = bench.add_parser("soak", help="the server under twice the load it can take, then killed and restarted",
                         description="Start `rarecache serve` on 127.0.0.1 (a free port), measure the rate it answers "
                                     "when kept full, offer --duration seconds of requests at --overload times that "
                                     "rate (small answers), recording its memory, then kill -9 it under load, "
                                     "restart it and send one request. Every accepted request must complete, every "
                                     "refusal must be a 503 with Retry-After. Prints a table, then one JSON line; "
                                     "exit 1 if a check fails. Loopback only.")
    b.add_argument("--source", default=None, help="as for serve (default: the bundled pair)")
    b.add_argument("--target", default=None, help="as for serve")
    b.add_argument("--map", type=Path, default=None,
                   help="as for serve (default for the bundled pair: the map rarecache ships)")
    b.add_argument("--saturation", type=float, default=20.0, help="seconds of the closed-loop rate measurement (20)")
    b.add_argument("--duration", type=float, default=180.0, help="seconds of overload (default: 180)")
    b.add_argument("--overload", type=float, default=2.0, help="offered rate over the measured one (default: 2)")
    b.add_argument("--max-requests", type=int, default=5000, help="at most this many overload requests (5000)")
    b.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request (default: 8)")
    b.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default: 8)")
    b.add_argument("--max-waiting", type=int, default=16, help="the server's --max-waiting (default: 16)")
    b.add_argument("--kill-after", type=float, default=5.0, help="seconds of load before the kill -9 (default: 5)")
    b.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    add_model_options(b)
    b.set_defaults(func=cmd_bench_soak)


def cmd_bench_soak(args) -> int:
    from ..bench.soak import SoakConfig, run_soak

    serve = [*(("--source", args.source) if args.source else ()), *(("--target", args.target) if args.target else ()),
             *(("--map", str(args.map)) if args.map else ()), "--dtype", args.dtype,
             *(("--cache-dir", str(args.cache_dir)) if args.cache_dir else ()),
             "--max-batch", str(args.max_batch), "--max-waiting", str(args.max_waiting)]
    cfg = SoakConfig(serve_args=tuple(serve), saturation_s=args.saturation, duration_s=args.duration,
                     overload=args.overload, max_requests=args.max_requests, max_tokens=args.max_tokens,
                     kill_after_s=args.kill_after)
    result = run_soak(cfg, emit=lambda line: print(line, flush=True))
    print_json(result, args.out, indent=1)
    return 0 if result["ok"] else 1
