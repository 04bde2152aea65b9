"""`rarecache eval run` (arms over a task's items, resumable) and `rarecache eval report`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..defaults import SERVED
from ..errors import RarecacheError
from ..registry import RANDOM, RANK, SELECTORS, TASKS
from .common import add_model_options, map_specs


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluation harness: accuracy kept by the handoff, resumable")
    ev = p.add_subparsers(dest="eval", required=True, metavar="ACTION")
    _add_run(ev)
    _add_report(ev)
    from .drift import register as register_drift
    from .gate import register as register_gate
    from .longctx import register as register_longctx
    from .probe import register as register_probe

    register_gate(ev)
    register_drift(ev)
    register_probe(ev)
    register_longctx(ev)


RUN_DESCRIPTION = """\
Evaluate the target alone, the source alone and handoffs at a grid of budgets and
selectors, through one or several maps, over a task's items. One JSON line per (item,
arm) is appended to --out as soon as it is done; rerunning the same command resumes (and
refuses other models, maps, dtype or an edited task file: see OUT.meta.json). A markdown
summary is written beside the results; `eval report` redraws it and the plots."""
TASK_FILE_HELP = """\
Your own task: --task FILE.jsonl, one item per line, all lines of one form:
  multiple choice (acc, acc_norm):
    {"id": "q1", "context": "What is 2 + 2?", "choices": ["3", "4"], "gold": 1}
  bits per byte of a continuation:
    {"context": "Summarise: ...", "continuation": "The text says ..."}
context is the user turn; messages (a chat list of {role, content} ending in a user turn)
may replace it. Answers are scored verbatim as the assistant's reply; id is optional (else a
hash of the line). A task map for it: rarecache calibrate --task FILE.jsonl --calibration
CAL.jsonl (the same forms, or {"text": ...}), checked disjoint from FILE by the sha256 of
each prompt here and when the map is used."""


def _add_run(ev) -> None:
    e = ev.add_parser("run", help="run arms over a task's items (per-item JSONL, resumes where it stopped)",
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=TASK_FILE_HELP,
                      description=RUN_DESCRIPTION)
    e.add_argument("--task", required=True,
                   help=f"one of: {', '.join(TASKS)}; or FILE.jsonl, your own items (formats below)")
    e.add_argument("--source", required=True, help="model whose cache is handed off (name, HF dir or .gguf)")
    e.add_argument("--target", required=True, help="model that answers (the direction is source -> target)")
    e.add_argument("--map", nargs="+", required=True, metavar="[LABEL=]FILE",
                   help="map file(s) fitted for source -> target; label several (task=A.safetensors "
                        "wiki=B.safetensors): every handoff arm runs through each, sharing the prefills")
    e.add_argument("--rhos", nargs="+", type=float, default=[0.0, 0.3],
                   help="rank-disagreement budgets (default: 0 0.3)")
    e.add_argument("--selectors", nargs="+", default=[RANDOM],
                   help=f"other selectors to run at --selector-rho: {' '.join(SELECTORS)} (default: {RANDOM}; "
                        f"served: {SERVED.selector} at {SERVED.rho:g})")
    e.add_argument("--selector-rho", type=float, default=0.3, help="budget of --selectors (default: 0.3)")
    e.add_argument("--arms", nargs="+", default=None,
                   help="explicit arms instead of the grid: target, source, RHO:SELECTOR[@LABEL]")
    e.add_argument("--length", type=int, default=None, metavar="T",
                   help="long-context tasks (retrieval, multidoc_qa, code_qa, multiturn, passage_qa_gen): the prompt "
                        "length in tokens, 1024, 2048 or 4096 (100 items at each)")
    e.add_argument("--limit", type=int, default=30, help="items to evaluate (default: 30)")
    e.add_argument("--start", type=int, default=0, help="first item (default: 0)")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="generation tasks: answer length cap (default: the task's own, gsm8k 1024, others 256; "
                        "gsm8k stops at its exemplars' end, coqa at the end of the answer line; each record "
                        "says whether the cap cut it: truncated)")
    e.add_argument("--batch", type=int, default=None,
                   help="generation: items whose arms decode together (default: the task's, 8; 1 for the "
                        "long-context tasks, whose rows are long)")
    e.add_argument("--out", type=Path, required=True, help="results JSONL (appended to; a summary .md beside it)")
    e.add_argument("--threads", type=int, default=None,
                   help="CPU threads for this run (torch.set_num_threads; default: torch's own, one per core). "
                        "Running several evaluations on one machine, give each 1: more threads than cores "
                        "cost CPU time and gain no wall time")
    add_model_options(e)
    e.set_defaults(func=cmd_eval_run)


def cmd_eval_run(args) -> int:
    from ..engine.generate import SamplingConfig
    from ..engine.llm import LLM
    from ..eval.report import by_turn, markdown, summarise, template_prompt_share
    from ..eval.results import load_results, map_shas, run_meta
    from ..eval.run import run_task
    from ..eval.tasks import LONG_CONTEXT, TASKS, open_task
    from ..transfer.mapper import Mapper

    # a task file is read and checked before any model loads; a registered task needs the tokenizer
    task = None if args.task in TASKS else open_task(args.task, args.cache_dir, length=args.length)
    if args.task in LONG_CONTEXT and args.length is None:
        raise RarecacheError(f"{args.task} is built at a length: give --length "
                             f"{' or '.join(map(str, TASKS[args.task].lengths))}")
    if args.task in TASKS and args.length is not None:
        open_task(args.task, args.cache_dir, length=args.length)  # refuses a length the task is not built at
    if args.limit < 1 or args.start < 0 or (args.batch is not None and args.batch < 1):
        raise RarecacheError("--limit and --batch must be >= 1 and --start >= 0")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise RarecacheError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.threads is not None:
        if args.threads < 1:
            raise RarecacheError(f"--threads must be >= 1 (got {args.threads})")
        import torch

        torch.set_num_threads(args.threads)  # before any model loads
    map_paths = map_specs(args.map)
    arms = _eval_arms(args, tuple(map_paths))
    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    task = task or open_task(args.task, args.cache_dir, source.tokenizer, length=args.length)
    all_items = task.items()
    items = all_items[args.start : args.start + args.limit]
    if not items:
        raise RarecacheError(f"{task.name} has {len(all_items)} evaluation items; --start {args.start} is past them")
    maps = {}
    for label, path in map_paths.items():
        maps[label] = Mapper.load(path)
        maps[label].check_pair(source.runner, target.runner)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens or task.max_new_tokens)
    meta = run_meta(task, source, target, map_paths, args.dtype, sampling)
    out = run_task(task, items, source, target, maps, arms, args.out, sampling, batch=args.batch or task.batch,
                   meta=meta)
    rows = load_results(out)
    bpb = task.metric == "bpb"
    maps_text = ", ".join(f"{k + '=' if k else ''}{v.name}" for k, v in map_paths.items())
    table = markdown(summarise(rows, task.metric, task.chance, lower_is_better=bpb),
                     f"{task.name}: {len({r['item'] for r in rows})} items, {source.path.name} -> {target.path.name}, "
                     f"map {maps_text}", metric=task.metric, percent=not bpb,
                     template_share=template_prompt_share(rows), shas=map_shas(out))
    turns = by_turn(rows, task.metric, percent=not bpb)
    table += f"\n\n{turns}" if turns else ""
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


def _eval_arms(args, labels: tuple[str, ...]) -> list:
    from ..eval.arms import parse_arms

    if args.arms:
        specs = args.arms
    else:
        specs = ["target", "source", *(f"{r:g}:{RANK}" for r in args.rhos),
                 *(f"{args.selector_rho:g}:{s}" for s in args.selectors if s != RANK)]
    return parse_arms(specs, labels)


REPORT_DESCRIPTION = """\
Per arm: the metric with its interval, against the target (retention, gap closed, paired
delta and p, and on right/wrong outcomes McNemar's exact p), and agreement with target (n):
the share of items whose answer (the choice chosen, or the generated answer GSM8K extracts)
equals the target's own answer on the same item; an exact tie between choices is an answer
of its own, agreeing only with the same tie (the ties column counts them). Bits per byte
tasks score a fixed text and give no answer, so their agreement is — (null in summary files):
read their paired delta vs the target instead, beside it weighted by bytes (total bits over
total bytes). Generation tasks count the answers cut at the token cap. Handoff arms carry
their map's sha256 prefix, as the results' meta file records it: rho=0.3/suffix@v4[7145adb2]."""


def _add_report(ev) -> None:
    e = ev.add_parser("report", help="summarise results JSONL files (and write the general map's summary)",
                      description=REPORT_DESCRIPTION)
    e.add_argument("results", type=Path, nargs="+",
                   help="results JSONL file(s), plain or gzipped as published (.jsonl.gz); each gets its own report")
    e.add_argument("--general-summary", type=Path, default=None, metavar="JSON",
                   help="also pick the default selector across the files (highest mean share of the source-to-"
                        "target gap kept at rho 0.1, 0.2, 0.3; eval/summary.py says why not gap closed) and "
                        "write the summary there (e.g. general-map-summary.json)")
    e.add_argument("--fidelity-summary", type=Path, default=None, metavar="JSON",
                   help="also write what one handoff (--arm) through one map (--map-label) changes against the "
                        "target on each file's task, beside --previous-label's map: per task the target, the source "
                        "alone and the handoff, delta = handoff - target (pp for accuracy, bpb for bits per byte) "
                        "with its paired bootstrap 95 percent interval, and agreement, the share of items whose answer equals "
                        "the target's (null on bits per byte tasks, which score a fixed text and have no answer: "
                        "read their delta), all on the items every arm answered (e.g. "
                        "docs/artifacts/fidelity-summary.json)")
    e.add_argument("--arm", default=None, metavar="RHO:SELECTOR",
                   help="--fidelity-summary: the handoff it summarises (e.g. 0.2:suffix)")
    e.add_argument("--previous-label", default=None,
                   help="--fidelity-summary: the map label of the map it would replace (the same arm through it)")
    e.add_argument("--previous-arm", default=None, metavar="RHO:SELECTOR",
                   help="--fidelity-summary: the handoff through --previous-label's map, when that map was served "
                        "with another default (default: --arm)")
    e.add_argument("--probe", type=Path, default=None, metavar="SUMMARY",
                   help="--fidelity-summary: the probe's figures for the arm, from the OUT.summary.json "
                        "`eval probe` wrote over both maps")
    e.add_argument("--drift", type=Path, default=None, metavar="DRIFT",
                   help="--fidelity-summary: an `eval drift run` file through the same map, for coqa_bpb (its "
                        "switch/RHO:SELECTOR arm against the target alone, over the target's turns)")
    e.add_argument("--previous-drift", type=Path, default=None, metavar="DRIFT",
                   help="--fidelity-summary: the same through --previous-label's map")
    e.add_argument("--map-label", default=None,
                   help="--general-summary: the map label the arms go through, if the files have several; "
                        "--fidelity-summary: the map it summarises")
    e.add_argument("--plain-label", default=None,
                   help="the map label plain transfer (rho 0) is read from, for gap closed and the summary's "
                        "plain_minus_source (default: each arm's own map), when the results measured it through "
                        "another fit of the same map")
    e.add_argument("--served-map", type=Path, default=None, metavar="MAP",
                   help="--general-summary: the one map file that serves both (a map whose plain view is "
                        "--plain-label's and whose fit is --map-label's, checked in code); the summary names it")
    e.add_argument("--compact", action="store_true",
                   help="one row per arm, one column group per map (metric, floor-normalised retention, gap closed, "
                        "p vs target and vs rank)")
    e.add_argument("--plots", type=Path, default=None,
                   help="also draw metric-vs-rho and selectors-at-rho-0.3 PNGs into this folder")
    e.add_argument("--metric", default=None,
                   help="field to summarise (default: the task's headline metric, e.g. correct_norm for "
                        "ARC and HellaSwag; correct gives their unnormalised accuracy)")
    e.set_defaults(func=cmd_eval_report)


def cmd_eval_report(args) -> int:
    if args.served_map and not args.general_summary:
        raise RarecacheError("--served-map and the check it asks for belong to --general-summary")
    if args.map_label and not (args.general_summary or args.fidelity_summary):
        raise RarecacheError("--map-label belongs to --general-summary or --fidelity-summary")
    fidelity = (args.arm, args.previous_label, args.previous_arm, args.probe, args.drift, args.previous_drift)
    if any(x is not None for x in fidelity) and not args.fidelity_summary:
        raise RarecacheError("--arm, --previous-label, --previous-arm, --probe and the drift files belong to "
                             "--fidelity-summary")
    if args.previous_arm is not None and args.previous_label is None:
        raise RarecacheError("--previous-arm needs --previous-label (the map it goes through)")
    if args.fidelity_summary and (args.arm is None or args.map_label is None):
        raise RarecacheError("--fidelity-summary needs --arm RHO:SELECTOR and --map-label LABEL")
    for k, path in enumerate(args.results):
        if not path.is_file():
            raise RarecacheError(f"no results file {path}")
        if k:
            print()
        _report(args, path)
    if args.general_summary:
        import json

        from ..eval.summary import general_summary, markdown

        summary = general_summary(args.results, args.map_label, args.plain_label, args.served_map)
        print("\n" + markdown(summary))
        args.general_summary.parent.mkdir(parents=True, exist_ok=True)
        args.general_summary.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.general_summary}", file=sys.stderr)
    if args.fidelity_summary:
        _fidelity(args)
    return 0


def _fidelity(args) -> None:
    import json

    from ..eval.fidelity import fidelity_summary, markdown

    if args.probe is not None and not args.probe.is_file():
        raise RarecacheError(f"no probe summary {args.probe}")
    for drift in (args.drift, args.previous_drift):
        if drift is not None and not drift.is_file():
            raise RarecacheError(f"no drift results file {drift}")
    summary = fidelity_summary(args.results, args.arm, args.map_label, args.previous_label, args.probe,
                               args.drift, args.previous_drift, args.previous_arm)
    print("\n" + markdown(summary, args.map_label, args.previous_label))
    args.fidelity_summary.parent.mkdir(parents=True, exist_ok=True)
    args.fidelity_summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.fidelity_summary}", file=sys.stderr)


def _report(args, path: Path) -> None:
    from ..eval.report import by_turn, compact, mark_truncated, markdown, summarise, template_prompt_share
    from ..eval.results import generation_cap, load_results, map_shas, run_record
    from ..eval.tasks import TASKS
    from ..eval.tasks.custom import headline

    rows = load_results(path)
    if not rows:
        raise RarecacheError(f"{path} holds no results yet")
    # maps by sha256 prefix where the run's record exists (a file without one prints its labels as they are)
    rows, shas = mark_truncated(rows, generation_cap(path)), map_shas(path) if run_record(path) else None
    task = TASKS[rows[0]["task"]] if rows[0].get("task") in TASKS else None
    default, chance = (task.metric, task.chance) if task else headline(rows)  # a task file's: from its rows
    metric = args.metric or default
    if not any(metric in r for r in rows):
        fields = sorted({k for r in rows for k, v in r.items() if isinstance(v, (bool, int, float))
                         and k not in ("gold", "prediction", "prediction_norm")})
        raise RarecacheError(f"{path} has no metric {metric!r}; its numeric fields: {', '.join(fields)}")
    bpb = metric == "bpb"
    items = len({r["item"] for r in rows})
    summary = summarise(rows, metric, chance, lower_is_better=bpb, plain_label=args.plain_label)
    if args.compact:
        print(compact(summary, metric, percent=not bpb, plain_label=args.plain_label, shas=shas))
    else:
        print(markdown(summary, f"{path} ({items} items)", metric=metric, percent=not bpb,
                       template_share=template_prompt_share(rows), plain_label=args.plain_label, shas=shas))
    turns = by_turn(rows, metric, percent=not bpb)
    if turns:
        print(f"\n{turns}")
    if args.plots:
        from ..eval.plots import plot_selectors, plot_vs_rho
        from ..eval.results import results_stem

        args.plots.mkdir(parents=True, exist_ok=True)
        stem = results_stem(path) + (f"-{metric}" if args.metric else "")
        title = f"{stem} ({items} items)"
        plot_vs_rho(rows, metric, args.plots / f"{stem}-vs-rho.png", title, lower_is_better=bpb)
        plot_selectors(rows, metric, args.plots / f"{stem}-selectors.png", title, lower_is_better=bpb)
        print(f"wrote {args.plots}/{stem}-vs-rho.png and -selectors.png", file=sys.stderr)
