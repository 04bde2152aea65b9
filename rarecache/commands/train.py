"""Maps made by training on a map's own calibration text: `rarecache mlp` (a residual MLP on ridge's residual)
and `rarecache refine` (the map's weight and bias on the target's next-token KL). Both name the map's text
again, checked by fingerprint; `calibrate` and `refit`, which fit from statistics, are commands/maps.py."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import RarecacheError
from ..registry import PRESETS
from .common import add_model_options, load_models
from .maps import _check_corpus_flags, _corpus, add_weights_option

REFINE_LR = 1e-5  # fitting.refine.RefineConfig.lr, spelled here so --help imports no torch (a test holds them equal)


def register(sub) -> None:
    _add_mlp(sub)
    _add_refine(sub)


def _add_map_text_options(p, about: str) -> None:
    """A map, its pair, and its calibration text named again (checked by fingerprint): for the commands that
    train on that text (`mlp`, `refine`)."""
    p.add_argument("map", type=Path, help=about)
    p.add_argument("--source", required=True, help="the map's source model")
    p.add_argument("--target", required=True, help="the map's target model")
    p.add_argument("--corpus", default="wiki", help="the map's calibration corpus (default: wiki)")
    p.add_argument("--chat", action="store_true", help="as the map's calibration was run with --chat")
    p.add_argument("--task", default=None, help="the map's calibration task")
    p.add_argument("--calibration", type=Path, default=None, metavar="CAL.jsonl",
                   help="the map's --calibration file (with a task file as --task)")
    p.add_argument("--preset", choices=PRESETS.names, default=None, help="the map's calibration preset")


def _add_mlp(sub) -> None:
    p = sub.add_parser("mlp", help="add the nonlinear option to a ridge map: a residual MLP per target layer and side",
                       description="Collect both models' rows on the map's own calibration text (its fit documents "
                                   "for training, the documents after them for early stopping and held-out R2), "
                                   "train an MLP per target layer and side on ridge's residual, and write a map "
                                   "that applies ridge + MLP (the closed-form KV mapping paper, arXiv 2608.03893, "
                                   "§4.4). Give the same text as the map's calibration (--preset, --task or "
                                   "--corpus): it is checked by fingerprint.")
    _add_map_text_options(p, "ridge map fitted by `rarecache calibrate`")
    p.add_argument("--tokens", type=int, default=16384, help="training positions (default: 16384)")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out positions (default: 4096)")
    p.add_argument("--hidden", type=int, default=256, help="hidden units (default: 256)")
    p.add_argument("--epochs", type=int, default=30, help="at most (early stopping on held-out; default: 30)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--out", type=Path, required=True, help="map file to write (ridge + MLP)")
    add_model_options(p)
    add_weights_option(p)
    p.set_defaults(func=cmd_mlp)


def cmd_mlp(args) -> int:
    from ..transfer.mapper import Mapper
    from ..transfer.fitting.mlp import MLPConfig, fit_mlp

    _check_corpus_flags(args)
    if args.tokens < 1 or args.heldout_tokens < 1:
        raise RarecacheError("--tokens and --heldout-tokens must be >= 1")
    try:
        cfg = MLPConfig(hidden=args.hidden, epochs=args.epochs)
    except ValueError as e:
        raise RarecacheError(str(e)) from None
    mapper = Mapper.load(args.map)
    source, target, tokenizer = load_models(args)
    mapper.check_pair(source, target)
    corpus = _corpus(args, tokenizer)
    out, r2 = fit_mlp(mapper, source, target, tokenizer, corpus, cfg, args.tokens, args.heldout_tokens, args.seq_len,
                      str(args.map))
    out.save(args.out, args.weights_dtype)
    print(f"held-out R2, mean over {target.num_layers} target layers ({args.heldout_tokens} positions after the map's "
          f"fit documents):")
    for s, name in (("k", "keys"), ("v", "values")):
        ridge, mlp = (sum(r2[s][k]) / len(r2[s][k]) for k in ("ridge", "mlp"))
        print(f"  {name:6s} ridge {ridge:.4f}  ridge + MLP {mlp:.4f}  ({mlp - ridge:+.4f})")
    print(json.dumps({"mlp": str(args.out), "hidden": cfg.hidden, "heldout_r2": r2}))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _add_refine(sub) -> None:
    p = sub.add_parser("refine", help="refine a ridge map on the target's own next-token distribution (KL)",
                       description="Starting from the closed-form fit, take gradient steps on the map's weight and "
                                   "bias that bring the target's next-token distribution over a handed-off cache "
                                   "(a suffix recomputed at a budget drawn from --rhos, the rest mapped) closer to "
                                   "its own, on the map's calibration text after its fit documents; held-out "
                                   "sequences after those pick the step kept. The map's form and serving cost are "
                                   "unchanged. Give the same text as the map's calibration (--preset, --task or "
                                   "--corpus): it is checked by fingerprint. An interrupted run resumes from "
                                   "OUT.refine-state, saved at every held-out check.")
    _add_map_text_options(p, "dense ridge map fitted by `rarecache calibrate`")
    p.add_argument("--steps", type=int, default=300, help="training sequences, one per step (default: 300)")
    p.add_argument("--lr", type=float, default=REFINE_LR,
                   help=f"Adam's step, on standardised inputs in units of each layer's row spread (default: {REFINE_LR:g})")
    p.add_argument("--rhos", type=float, nargs="+", default=[0.1, 0.2, 0.3],
                   help="budgets the recomputed suffix is drawn from (default: 0.1 0.2 0.3)")
    p.add_argument("--weighting", choices=("uniform", "context"), default="uniform",
                   help="the loss over recomputed positions: uniform (default), or context: each position weighted "
                        "by how much the target's prediction there reads text more than 16 tokens back")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="both distributions' temperature in the KL, in (0, 1]: below 1 the loss weighs whether the "
                        "map keeps the target's top choices, where a flat teacher (a multiple-choice answer) gives "
                        "KL at 1 little to pay for a wrong argmax (default: 1)")
    p.add_argument("--heldout", type=int, default=12, help="held-out sequences (default: 12)")
    p.add_argument("--every", type=int, default=50, help="steps between held-out checks (default: 50)")
    p.add_argument("--seq-len", type=int, default=512, help="longest sequence (default: 512)")
    p.add_argument("--prompts", nargs="+", default=[], metavar="TASK",
                   help="also train on whole prompts of these tasks' calibration pools, in their evaluated format "
                        "(e.g. mmlu arc_challenge: the answer is read at the prompt's end), checked disjoint from "
                        "their evaluated items; the map records the prompts it read and evaluations refuse it on them")
    p.add_argument("--prompt-share", type=float, default=0.3,
                   help="with --prompts: their share of the training and held-out sequences (default: 0.3)")
    p.add_argument("--out", type=Path, required=True, help="map file to write")
    add_model_options(p)
    add_weights_option(p)
    p.set_defaults(func=cmd_refine)


def _prompt_tasks(args) -> list:
    """The registered tasks --prompts names (their pools are read later, with the tokenizer), refused early."""
    from ..eval.tasks import TASKS

    unknown = [t for t in args.prompts if t not in TASKS]
    if unknown:
        raise RarecacheError(f"--prompts: unknown task(s) {', '.join(unknown)}; registered: {', '.join(sorted(TASKS))}")
    if len(set(args.prompts)) != len(args.prompts):
        raise RarecacheError("--prompts names a task twice")
    if args.prompts and not 0 < args.prompt_share < 1:
        raise RarecacheError(f"--prompt-share must lie strictly between 0 and 1, got {args.prompt_share}")
    return [TASKS[t](args.cache_dir) for t in args.prompts]


def cmd_refine(args) -> int:
    from ..transfer.mapper import Mapper
    from ..transfer.fitting.refine import RefineConfig, refine

    _check_corpus_flags(args)
    if any(not 0 < r < 1 for r in args.rhos):
        raise RarecacheError(f"--rhos must lie strictly between 0 and 1, got {' '.join(map(str, args.rhos))}")
    if args.seq_len < 2:
        raise RarecacheError(f"--seq-len must be at least 2, got {args.seq_len}")
    prompt_tasks = _prompt_tasks(args)
    cfg = RefineConfig(steps=args.steps, lr=args.lr, rhos=tuple(args.rhos), heldout=args.heldout, every=args.every,
                       weighting=args.weighting, temperature=args.temperature,
                       prompt_share=args.prompt_share if prompt_tasks else 0.0,
                       seq_len=args.seq_len, min_len=min(64, args.seq_len))  # (refuses bad values before loading)
    mapper = Mapper.load(args.map)
    if mapper.info.mlp_hidden or mapper.info.heads:
        raise RarecacheError(f"{args.map} is not a dense linear map (head-matched or with an MLP): nothing to refine")
    source, target, tokenizer = load_models(args, pack_target=False)  # gradients run through the target's layers
    mapper.check_pair(source, target)
    corpus = _corpus(args, tokenizer)
    mapper.check_corpus(corpus, str(args.map))
    first = mapper.info.calibration.get("documents_used", 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = args.out.with_name(args.out.name + ".refine-state")  # saved at every check; a rerun resumes from it
    prompts = {t.name: t.calibration_corpus() for t in prompt_tasks}  # (each checked disjoint from its items)
    out, record = refine(mapper, source, target, tokenizer, corpus, replace(cfg, first_document=first),
                         log=lambda line: print(line, file=sys.stderr, flush=True), state=state, prompts=prompts)
    out.save(args.out, args.weights_dtype)
    state.unlink(missing_ok=True)
    print(f"held-out KL {record['heldout_kl_before']:.4f} -> {record['heldout_kl']:.4f} nats "
          f"(step {record['kept_step']} of {record['steps']} kept)")
    print(json.dumps({"refine": str(args.out), **{k: v for k, v in record.items() if k != "checks"}}))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
