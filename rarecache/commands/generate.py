"""`rarecache generate`: one model, or a handoff from --source through --map to it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..defaults import SERVED, selector_help
from ..errors import RarecacheError
from .common import add_model_options, add_sampling_options, fill_served_defaults


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with one model",
                       description="Generate from a model given by bundled name (pulled on first use), "
                                   "local HF directory or GGUF file. Several prompts run as one batch.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (default: read stdin)")
    p.add_argument("--model", "--target", dest="model", required=True,
                   help="the model that answers: bundled name, HF directory or .gguf file")
    p.add_argument("--source", default=None,
                   help="hand off from this model's cache (through --map; the bundled pair has a default map)")
    p.add_argument("--map", type=Path, default=None,
                   help="map file fitted for source -> target (default for the bundled pair: the map serve uses)")
    p.add_argument("--rho", type=float, default=None,
                   help=f"share of prompt positions the target recomputes (default: {SERVED.rho:g}, the served "
                        "default; 0 = plain transfer, 1 = full prefill)")
    p.add_argument("--selector", default=None, help=selector_help())
    p.add_argument("--compare", action="store_true",
                   help="also print the target-alone and source-alone answers and the token agreement")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from ..engine.generate import SamplingConfig
    from ..engine.llm import LLM

    prompts = args.prompts or [sys.stdin.read()]
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [[*messages, {"role": "user", "content": p}] for p in prompts]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)  # a bad value is refused here, before loading
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


def _generate_handoff(args, prompts, sampling) -> int:
    from ..transfer.costs import describe_recompute
    from ..transfer.handoff import HandoffConfig
    from ..transfer.mapper import Mapper
    from ..transfer.pipeline import Pipeline

    if not args.source:
        raise RarecacheError("a handoff needs --source (and --model/--target)")
    if "map" in (notes := fill_served_defaults(args, args.source, args.model)):  # (the selector: on the last line)
        print(notes["map"], file=sys.stderr)
    if args.map is None:
        raise RarecacheError(f"give --map: only the bundled pair ({SERVED.source} -> {SERVED.target}) has a default")
    cfg = HandoffConfig.named(args.rho, args.selector, args.seed)
    mapper = Mapper.load(args.map)  # a damaged map fails here, in a second, before the weights load (as serve)
    pipe = Pipeline(args.source, args.model, mapper, dtype=args.dtype, cache_dir=args.cache_dir)
    outs, res = pipe.generate(prompts, cfg, sampling)
    t = res.timings
    report = []
    for i, o in enumerate(outs):
        first = res.first_pass[i] if res.first_pass else None
        entry = {"text": o.text, "prompt_tokens": o.prompt_tokens, "recomputed": res.recomputed(i),
                 **({"first_pass": len(first)} if first is not None else {}), "finish_reason": o.finish_reason,
                 "cost": describe_recompute(pipe.target.config, o.prompt_tokens, res.positions[i], first)
                 if res.prefix_layers is None else f"the first {res.prefix_layers} layers for every position"}
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
    if not args.json:
        for i, e in enumerate(report):
            print(f"{f'[{i}] ' if len(report) > 1 else ''}{e['cost']}", file=sys.stderr)
    phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in t.items())
    print(f"[{pipe.source.path.name} -> {pipe.target.path.name}, rho={cfg.rho}, selector={cfg.name}, "
          f"{args.dtype}] {phases}", file=sys.stderr)
    return 0


def _agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two generations agree, up to the longer one's length."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0
