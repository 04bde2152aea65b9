"""Map files: `rarecache calibrate` fits one, `refit` makes another from its kept statistics (`mlp` and `refine`,
which train on the map's own text, are commands/train.py; `inspect`, which shows one, is commands/inspect.py;
`ppl`, which scores what a map keeps, an evaluation, commands/ppl.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import RarecacheError
from ..registry import GENERAL, PRESETS
from .common import add_model_options, load_models, warn_fit


def register(sub) -> None:
    _add_calibrate(sub)
    _add_refit(sub)


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
    p.add_argument("--preset", choices=PRESETS.names, default=None,
                   help="general: the chat-formatted mix of the served map, meant to serve all traffic, "
                        "checked disjoint from every task's evaluated items, instead of --corpus; it is general-v3: "
                        "multi-turn reading conversations, unevaluated few-shot tasks, math, code, prose (that "
                        "much is general-v2, the mix served before) and few-shot chains of GSM8K's held-apart "
                        "word problems (docs/RESULTS.md 8, 8.3); general-v4 and -v5 (candidates) add the long-context "
                        "tasks' held-apart items, whole at 1k and 2k tokens, 2 and 8 documents a round")
    p.add_argument("--tokens", type=int, default=65536, help="calibration positions for the fit (default: 65536)")
    p.add_argument("--heldout-tokens", type=int, default=8192,
                   help="positions from later documents for held-out R2 (default: 8192; 0 = none)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per calibration sequence (default: 512; 1024 with a --preset, whose few-shot "
                        "chains are that long; 2048 with general-v4 and -v5, whose long items are)")
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
    from ..transfer.fitting.calibrate import with_plain
    from ..transfer.fitting.refit import refit, resharpen
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
        if args.preset != GENERAL:
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
    from ..transfer.fitting.corpus import load_corpus

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
    from ..transfer.fitting.calibrate import Calibration, CalibrationConfig

    from ..eval import mix

    if args.weight_cap != 8.0 and not args.attention_weights:
        raise RarecacheError("--weight-cap belongs to --attention-weights")
    general = args.preset is not None  # every preset is a general mix: its sequence length and sharpening
    cfg = CalibrationConfig(tokens=args.tokens, heldout_tokens=args.heldout_tokens,
                            seq_len=args.seq_len or (mix.seq_len(args.preset) if general else 512),
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
