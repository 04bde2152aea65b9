"""Map files: `rarecache calibrate` fits one, `refit`, `mlp` and `refine` make another from it (`inspect`, which
shows one, is commands/inspect.py; `ppl`, which scores what a map keeps, an evaluation, commands/ppl.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import RarecacheError
from .common import add_model_options, load_models, warn_fit

# general (the served mix) and eval.mix.MIXES' names: --help imports no evaluation code; a test holds them equal
PRESETS = ("general", "general-v2", "general-v3")
REFINE_LR = 1e-5  # transfer.refine.RefineConfig.lr, spelled here so --help imports no torch (a test holds them equal)


def register(sub) -> None:
    _add_calibrate(sub)
    _add_refit(sub)
    _add_mlp(sub)
    _add_refine(sub)


def _add_calibrate(sub) -> None:
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
                   help="calibrate on a task's held-apart prompts instead of --corpus (e.g. gsm8k); for your own "
                        "task file (eval run --task FILE.jsonl), give its data with --calibration")
    p.add_argument("--calibration", type=Path, default=None, metavar="CAL.jsonl",
                   help="with --task FILE.jsonl: the map's data, lines of the task's forms or {\"text\": ...} "
                        "(a user turn); refused if any prompt is one of FILE's (by sha256)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="general: the chat-formatted mix of the served map, meant to serve all traffic, "
                        "checked disjoint from every task's evaluated items, instead of --corpus; it is general-v3: "
                        "multi-turn reading conversations, unevaluated few-shot tasks, math, code, prose (that "
                        "much is general-v2, the mix served before) and few-shot chains of GSM8K's held-apart "
                        "word problems (docs/RESULTS.md 8, 8.3)")
    p.add_argument("--tokens", type=int, default=65536, help="calibration positions for the fit (default: 65536)")
    p.add_argument("--heldout-tokens", type=int, default=8192,
                   help="positions from later documents for held-out R2 (default: 8192; 0 = none)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per calibration sequence (default: 512; 1024 with a --preset, whose few-shot "
                        "chains are that long)")
    p.add_argument("--stride", type=int, default=1, help="sample every STRIDE-th position (default: 1)")
    p.add_argument("--skip-first", type=int, default=0, help="leave out the first N positions (default: 0)")
    p.add_argument("--k", type=int, default=8, help="source layers per target layer (default: 8)")
    p.add_argument("--lam", type=float, default=0.01, help="ridge lambda (default: 0.01)")
    p.add_argument("--rank", type=int, default=None, help="rank-disagreement probe rank r (default: d_t/8)")
    p.add_argument("--head-matched", action="store_true",
                   help="fit each target KV head only from the same head of the source layers (both models need "
                        "the same number of KV heads): 1/H of the statistics memory and of the map file")
    add_sharpen_option(p, "none", "--sharpen's; --preset general: keys 1, values 0.5 (handoffs: plain ridge)")
    p.add_argument("--token-inputs", action="store_true",
                   help="every target layer's ridge also reads the target's own layer-0 K and V rows of the token "
                        "(computed exactly from the token), beside the source rows; recorded in the map")
    p.add_argument("--exact-layer0", action="store_true",
                   help="the target's layer-0 K/V rows are computed from the token (embedding, norm, projection), "
                        "not mapped; recorded in the map")
    p.add_argument("--attention-weights", type=float, default=0.0, metavar="POWER",
                   help="weigh each fit position by the attention it receives in the target's own prefill "
                        "(summed over the queries that read it, mean over layers and heads), as "
                        "(received / mean over the sequence's fit positions)^POWER capped at --weight-cap, so that "
                        "the rows the target reads most are fitted most closely (CacheBridge's attention-"
                        "sensitivity weighting, shared by every target layer; the in-sample R2 that picks source "
                        "layers is weighted too, held-out R2 is not); 0 = every position alike (default); "
                        "recorded in the map")
    p.add_argument("--weight-cap", type=float, default=8.0,
                   help="with --attention-weights: the largest weight before scaling to mean 1 (the attention "
                        "sink receives hundreds of times the mean; default: 8)")
    p.add_argument("--out", type=Path, default=None,
                   help="map file to write (.safetensors); with --preset general the default is the general "
                        "map's place, where `rarecache serve` looks for it: "
                        "~/.cache/rarecache/maps/general-SOURCE-to-TARGET.safetensors")
    p.add_argument("--restart", action="store_true", help="discard a saved state and start over")
    p.add_argument("--keep-state", action="store_true",
                   help="keep OUT.state (the float64 statistics) after the fit, for `rarecache refit`")
    p.add_argument("--device", default="cpu", help="where statistics accumulate (default: cpu)")
    add_model_options(p)
    add_weights_option(p)
    p.set_defaults(func=cmd_calibrate)


def _add_refit(sub) -> None:
    p = sub.add_parser("refit", help="fit a map again from its kept calibration statistics (other k, lambda, "
                                     "rank, or head-matched), in seconds",
                       description="Read MAP and MAP.state (written by `calibrate --keep-state`) and fit again "
                                   "with other choices. A dense state also gives the head-matched map of the "
                                   "same positions. The new map keeps MAP's models, corpus and documents. "
                                   "--sharpen and --plain-sharpen need no state: a dense map's sharpening is "
                                   "undone and redone exactly (its recorded held-out R2 is dropped), and "
                                   "--plain-sharpen alone changes only the file's metadata; with no choice given, "
                                   "--weights-dtype alone writes MAP again as it is (bfloat16: in half the bytes).")
    p.add_argument("--map", type=Path, required=True, help="map whose calibration kept its state (MAP.state)")
    p.add_argument("--state", type=Path, default=None, help="the statistics (default: MAP.state)")
    p.add_argument("--k", type=int, default=None, help="source layers per target layer (default: MAP's)")
    p.add_argument("--lam", type=float, default=None, help="ridge lambda (default: MAP's)")
    p.add_argument("--rank", type=int, default=None, help="rank-disagreement probe rank (default: MAP's)")
    p.add_argument("--head-matched", action="store_true", help="fit each target KV head from the same source head")
    add_sharpen_option(p, "MAP's", "MAP's")
    p.add_argument("--out", type=Path, required=True, help="map file to write")
    add_weights_option(p)
    p.set_defaults(func=cmd_refit)


def add_weights_option(p) -> None:
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default=None,
                   help="how the file stores the map's weights: bfloat16 halves the file (a bfloat16 handoff "
                        "through its fit maps the same rows from either; plain transfer and float32 handoffs see "
                        "the rounding) (default: float32 for a new map, else as MAP's file)")


def add_sharpen_option(p, default: str, plain_default: str) -> None:
    p.add_argument("--sharpen", type=float, nargs=2, default=None, metavar=("KEYS", "VALUES"),
                   help="scale each layer's centred keys / values by R2^-P, undoing part of ridge's shrinkage "
                        f"(0 = plain ridge, 0.5 = the target's variance; docs/RESULTS.md 8) (default: {default})")
    p.add_argument("--plain-sharpen", type=float, nargs=2, default=None, metavar=("KEYS", "VALUES"),
                   help="the sharpening plain transfer uses (a handoff that recomputes only the last position), "
                        "recorded in the file and applied to its one set of tensors at rho 0; handoffs that "
                        f"recompute positions use --sharpen's (docs/RESULTS.md 8.1) (default: {plain_default})")


def cmd_refit(args) -> int:
    from ..transfer.calibrate import with_plain
    from ..transfer.refit import refit, resharpen
    from ..transfer.mapper import Mapper

    mapper = Mapper.load(args.map)
    state = args.state or Path(str(args.map) + ".state")
    only_sharpen = (args.sharpen, args.plain_sharpen) != (None, None) and (
        args.k, args.lam, args.rank, args.head_matched) == (None, None, None, False)
    unchanged = (args.k, args.lam, args.rank, args.head_matched, args.sharpen, args.plain_sharpen) == (
        None, None, None, False, None, None)
    if unchanged and args.state is None and args.weights_dtype:  # the same map, stored again in that dtype
        new = mapper
    elif only_sharpen and args.sharpen is None and args.state is None:  # metadata only
        new = mapper
    elif not state.is_file() and only_sharpen and args.state is None:  # exact from the map alone (resharpen)
        new = resharpen(mapper, tuple(args.sharpen))
    elif not state.is_file():
        raise RarecacheError(f"no calibration state {state}: calibrate with --keep-state to keep one (only "
                             "--sharpen and --plain-sharpen can change without it)")
    else:
        new = refit(mapper, state, args.k, args.lam, args.rank, args.head_matched,
                    tuple(args.sharpen) if args.sharpen else None)
    if args.plain_sharpen:
        new = with_plain(new, tuple(args.plain_sharpen))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new.save(args.out, args.weights_dtype)
    print(new.summary())
    warn_fit(new)
    print(f"wrote {args.out}")
    return 0


def _check_corpus_flags(args) -> None:
    """Before any model loads: the calibration text is named once."""
    if args.task and args.preset:
        raise RarecacheError("give --task or --preset, not both")
    if args.calibration is not None and not args.task:
        raise RarecacheError("--calibration is a task file's data: give it with --task FILE.jsonl")
    if getattr(args, "out", "") is None:
        if args.preset != "general":
            raise RarecacheError("give --out FILE (only --preset general has a default place)")
        from ..defaults import general_map_path

        args.out = general_map_path(args.source, args.target, args.cache_dir)


def _task_file_corpus(args):
    """A task file's calibration corpus, read and checked before any model loads; None for other text."""
    from ..eval.tasks import TASKS, open_task

    if not args.task or args.task in TASKS:
        return None
    return open_task(args.task, args.cache_dir, calibration=args.calibration).calibration_corpus()


def _corpus(args, tokenizer):
    """The calibration text --preset, --task or --corpus names (flags checked by _check_corpus_flags)."""
    from ..transfer.corpus import load_corpus

    if args.preset:
        from ..eval.mix import general_corpus
        from ..eval.tasks import TASKS

        corpus, dropped = general_corpus({n: T(args.cache_dir, tokenizer=tokenizer) for n, T in TASKS.items()},
                                         args.cache_dir, args.preset)
        print(f"{corpus.name} mix: {len(corpus.documents)} documents ({dropped} dropped for sharing a line with "
              f"an evaluated item of {len(TASKS)} tasks)", file=sys.stderr)
        return corpus
    if args.task:
        from ..eval.tasks import open_task

        return open_task(args.task, args.cache_dir, tokenizer, args.calibration).calibration_corpus()
    return load_corpus(args.corpus, chat=args.chat, cache_dir=args.cache_dir)


def _sharpening(args, general: bool) -> dict:
    """The fit's and plain transfer's sharpening: as given, else the preset's (a general map: plain ridge, and
    plain transfer sharpened by mix.SHARPEN; head-matched, which has one fit for every budget: mix.SHARPEN)."""
    if args.sharpen is not None or not general:
        return {"sharpen": tuple(args.sharpen or (0.0, 0.0)),
                "plain_sharpen": tuple(args.plain_sharpen) if args.plain_sharpen else None}
    from ..eval import mix

    if args.head_matched:
        return {"sharpen": mix.SHARPEN, "plain_sharpen": tuple(args.plain_sharpen) if args.plain_sharpen else None}
    return {"sharpen": (0.0, 0.0), "plain_sharpen": tuple(args.plain_sharpen or mix.SHARPEN)}


def cmd_calibrate(args) -> int:
    from ..transfer.calibrate import Calibration, CalibrationConfig

    from ..eval import mix

    if args.weight_cap != 8.0 and not args.attention_weights:
        raise RarecacheError("--weight-cap belongs to --attention-weights")
    general = args.preset is not None  # every preset is a general mix: its sequence length and sharpening
    cfg = CalibrationConfig(tokens=args.tokens, heldout_tokens=args.heldout_tokens,
                            seq_len=args.seq_len or (mix.SEQ_LEN if general else 512),
                            stride=args.stride, skip_first=args.skip_first, k=args.k, lam=args.lam,
                            rank=args.rank, head_matched=args.head_matched, token_inputs=args.token_inputs,
                            exact_layer0=args.exact_layer0, attention_weights=args.attention_weights,
                            weight_cap=args.weight_cap, **_sharpening(args, general))
    _check_corpus_flags(args)
    early = _task_file_corpus(args)
    source, target, tokenizer = load_models(args)
    corpus = early or _corpus(args, tokenizer)
    from ..transfer.costs import PairShape, describe

    print(describe(PairShape.of(source.config, target.config), cfg.k, cfg.rank, cfg.heldout_tokens > 0,
                   cfg.head_matched, cfg.token_inputs, cfg.exact_layer0),
          file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    calibration = Calibration(source, target, tokenizer, corpus, cfg, args.out, args.device)
    mapper = calibration.run(restart=args.restart)
    mapper.save(args.out, args.weights_dtype)
    if not args.keep_state:
        calibration.state_path.unlink(missing_ok=True)
    print(mapper.summary())
    warn_fit(mapper)
    print(f"wrote {args.out}")
    return 0


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
    p.add_argument("--preset", choices=PRESETS, default=None, help="the map's calibration preset")


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
    from ..transfer.mlp import MLPConfig
    from ..transfer.mlp_train import fit_mlp

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
    from ..transfer.refine import RefineConfig, refine

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
