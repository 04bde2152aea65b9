"""`rarecache inspect`: a map file's metadata and R² per layer, and what it does to a prompt (`--strip`,
`--diagnose`) or the manifest that pins it (`--manifest`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RarecacheError
from ..registry import ATTN_SOURCE, LAYER_PREFIX, RANDOM, RANK, SELECTORS
from .common import add_model_options, load_models, warn_fit


def register(sub) -> None:
    _add_inspect(sub)


def _add_inspect(sub) -> None:
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
    drawn = [n for n in SELECTORS if n != LAYER_PREFIX]
    p.add_argument("--selectors", nargs="+", default=[RANK, RANDOM, ATTN_SOURCE],
                   help=f"selectors to draw: {' '.join(drawn)} (default: {RANK} {RANDOM} {ATTN_SOURCE}; "
                        f"{' and '.join(SELECTORS.oracles)} are oracles)")
    p.add_argument("--diagnose", metavar="TASK", default=None,
                   help="the mapping paper's diagnostics on TASK's first evaluation prompts (needs --source, "
                        "--target): attention-output cosine, K/V error concentration and top-rho agreement per "
                        "target layer")
    p.add_argument("--prompts", type=int, default=8, help="prompts for --diagnose (default: 8)")
    p.add_argument("--max-tokens", type=int, default=512, help="--diagnose cuts prompts to this length (default: 512)")
    p.add_argument("--diagnose-plot", type=Path, default=None, help="draw the --diagnose curves to this PNG")
    p.add_argument("--manifest", type=Path, default=None,
                   help="write the map's manifest (sha256, the pair's fingerprints, tokenizer hash, KV layouts) "
                        "to this JSON file, for a deployment to pin (needs --source, --target)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="the target engine's ranks, for --manifest")
    add_model_options(p)
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from ..transfer.mapper import Mapper

    mapper = Mapper.load(args.map)
    i = mapper.info
    warn_fit(mapper)
    if args.json:
        print(json.dumps({"info": {**i.__dict__}, "r2": {s: mapper.sides[s].r2.tolist() for s in ("k", "v")},
                          "sources": {s: mapper.sides[s].sources.tolist() for s in ("k", "v")}}))
    else:
        print(mapper.summary())
        print(f"  source {i.source}\n  target {i.target}\n  calibration {i.calibration}")
        print("  layer  R2_K    R2_V    held_K  held_V  key sources")
        for l in range(mapper.sides["k"].r2.shape[0]):
            held = [i.r2_heldout[s][l] if s in i.r2_heldout else float("nan") for s in ("k", "v")]
            print(f"  {l:5d}  {mapper.sides['k'].r2[l]:.4f}  {mapper.sides['v'].r2[l]:.4f}  "
                  f"{held[0]:.4f}  {held[1]:.4f}  {mapper.sides['k'].sources[l].tolist()}")
    if args.plot:
        from ..transfer.map_plots import plot_r2

        plot_r2(mapper, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.strip:
        _strip(args, mapper)
    if args.diagnose:
        _diagnose(args, mapper)
    if args.manifest:
        _manifest(args, mapper)
    return 0


def _manifest(args, mapper) -> None:
    from ..models.store import resolve_model
    from ..transfer.manifest import deployed_manifest

    if not (args.source and args.target):
        raise RarecacheError("--manifest needs --source and --target (their tokenizer and KV layout)")
    src, tgt = (resolve_model(m, cache_dir=args.cache_dir) for m in (args.source, args.target))
    out = deployed_manifest(mapper, args.map, src, tgt, args.tensor_parallel)
    args.manifest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.manifest}", file=sys.stderr)


def _diagnose(args, mapper) -> None:
    from ..eval.tasks import TASKS
    from ..transfer.diagnostics import diagnose, plot_diagnostics

    if not (args.source and args.target):
        raise RarecacheError("--diagnose needs --source and --target")
    if args.diagnose not in TASKS:
        raise RarecacheError(f"unknown task {args.diagnose!r}; tasks: {', '.join(TASKS)}")
    if args.prompts < 1 or args.max_tokens < 2:
        raise RarecacheError("--prompts must be >= 1 and --max-tokens >= 2")
    source, target, tokenizer = load_models(args)
    mapper.check_pair(source, target)
    task = TASKS[args.diagnose](args.cache_dir, tokenizer=tokenizer)
    items = task.items()[: args.prompts]
    task.check_map(mapper, items)
    prompts = [(tokenizer.encode_chat(list(i.prompt)) if i.text is None else tokenizer.encode(i.prompt))
               [: args.max_tokens] for i in items]
    d = diagnose(source, target, mapper, prompts, args.rho)
    print(f"diagnostics on {d.prompts} {task.name} prompts ({d.tokens} tokens), rho {args.rho:g}")
    print("  layer  cosine  K-conc  V-conc  rank-agree  error-agree")
    for l in range(len(d.cosine)):
        print(f"  {l:5d}  {d.cosine[l]:.4f}  {d.k_concentration[l]:6.3f}  {d.v_concentration[l]:6.3f}  "
              f"{d.rank_agreement[l]:10.3f}  {d.error_agreement[l]:11.3f}")
    print(json.dumps({"diagnostics": task.name, "prompts": d.prompts, "tokens": d.tokens, "rho": args.rho,
                      "mean": d.summary(), "per_layer": {"cosine": d.cosine, "k_concentration": d.k_concentration,
                                                         "v_concentration": d.v_concentration,
                                                         "rank_agreement": d.rank_agreement,
                                                         "error_agreement": d.error_agreement}}))
    if args.diagnose_plot:
        plot_diagnostics(d, args.diagnose_plot, f"{mapper.info.direction}: {d.prompts} {task.name} prompts")
        print(f"wrote {args.diagnose_plot}", file=sys.stderr)


def _strip(args, mapper) -> None:
    from ..engine.llm import LLM
    from ..transfer.handoff import HandoffConfig, handoff
    from ..transfer.pipeline import Pipeline
    from ..transfer.map_plots import plot_strip
    from ..transfer.selectors import SELECTORS

    if not (args.source and args.target and args.prompt):
        raise RarecacheError("--strip needs --source, --target and --prompt")
    pipe = Pipeline(LLM(args.source, dtype=args.dtype, cache_dir=args.cache_dir),
                    LLM(args.target, dtype=args.dtype, cache_dir=args.cache_dir), mapper)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    ids = pipe.source.encode(prompt)
    picks, scores = {}, None
    for name in args.selectors:
        sel = SELECTORS.get(name)
        if sel is None:
            raise RarecacheError(f"unknown selector {name!r}; choose from {', '.join(SELECTORS)}")
        _, _, res = handoff(pipe.source.runner, pipe.target.runner, mapper, [ids],
                            HandoffConfig(rho=args.rho, selector=name))
        picks[sel.label] = res.positions[0]
        if name == RANK and res.scores is not None:  # (rho 1 scores nothing: every position is recomputed)
            scores = res.scores[0].tolist()
    tokens = [pipe.source.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    plot_strip(tokens, picks, scores, args.rho, args.strip)
    print(json.dumps({"tokens": tokens, "rho": args.rho, "picks": picks, "rank_scores": scores}))
    print(f"wrote {args.strip}", file=sys.stderr)
