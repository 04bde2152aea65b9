"""`rarecache eval probe`: the fast fidelity probe (eval/probe.py) over maps and arms."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import RarecacheError
from .common import add_model_options, map_specs

DESCRIPTION = """\
Hand a fixed set of 32 prompts (passages with a question, 0-shot multiple choice, few-shot
chains, multi-turn chat; drawn past every evaluated range and outside every calibration pool,
checked) through each map and arm, append a reference answer, and measure at every answer
position the KL divergence in bits from the target's own next-token distribution to the one
over the handoff's cache, how often the top token stays, and the attention-output cosine per
layer. One JSON line per (prompt, map, arm) in --out (resumes where it stopped); the means per
map and arm, overall and per category, in OUT.summary.json (what `eval report
--fidelity-summary --probe` reads). Minutes where a task run takes hours: for screening maps."""


def register(ev) -> None:
    p = ev.add_parser("probe", help="fast fidelity probe: KL from the target's own next tokens, per map and arm",
                      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="model whose cache is handed off (name, HF dir or .gguf)")
    p.add_argument("--target", required=True, help="model that answers")
    p.add_argument("--map", nargs="+", required=True, metavar="[LABEL=]FILE",
                   help="map file(s) for source -> target; label several (v3=A.safetensors v4=B.safetensors)")
    p.add_argument("--arms", nargs="+", default=["0:rank", "0.2:suffix", "0.2:rank"], metavar="RHO:SELECTOR",
                   help="handoffs probed through every map, read as eval run --arms reads them "
                        "(default: 0:rank 0.2:suffix 0.2:rank)")
    p.add_argument("--out", type=Path, required=True, help="probe JSONL (appended to; OUT.summary.json beside it)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    add_model_options(p)
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    map_paths = map_specs(args.map)
    variants = _variants(args.arms, tuple(map_paths))
    if args.threads is not None:
        if args.threads < 1:
            raise RarecacheError(f"--threads must be >= 1 (got {args.threads})")
        import torch

        torch.set_num_threads(args.threads)
    from ..engine.llm import LLM
    from ..eval.probe import SOURCES, build_set, markdown, run_probe, set_digest, summarise_probe
    from ..eval.results import RUN_KEYS, check_meta, load_results, models_meta
    from ..eval.tasks import TASKS
    from ..transfer.mapper import Mapper

    maps = {label: Mapper.load(path) for label, path in map_paths.items()}  # a bad file fails before the models
    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    for m in maps.values():
        m.check_pair(source.runner, target.runner)
    tasks = {name: TASKS[name](args.cache_dir, tokenizer=source.tokenizer) for name in SOURCES.values()}
    prompts = build_set(tasks)
    meta = {"task": "probe", "set": set_digest(prompts), "sampling": None, "logits": None,
            **models_meta(source, target, map_paths, args.dtype)}
    meta = check_meta(args.out, meta, RUN_KEYS + ("set",))  # (its maps: every map the file has seen)
    run_probe(prompts, source, target, maps, variants, args.out)
    summary = {"prompts": len(prompts), "set": meta["set"],
               "maps": {k: v["sha256"] for k, v in meta["maps"].items()},
               **summarise_probe(load_results(args.out), prompts)}
    path = args.out.with_suffix(".summary.json")
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))
    print(f"wrote {args.out} and {path}", file=sys.stderr)
    return 0


def _variants(specs: list[str], labels: tuple[str, ...]) -> list:
    """(map label, arm) for every arm through every map, arms read by eval.arms.handoff_arm."""
    from ..eval.arms import handoff_arm

    out = []
    for label in labels:
        for spec in specs:
            pair = (label, handoff_arm(spec, label))
            if pair not in out:
                out.append(pair)
    return out
