"""`rarecache eval drift run` (CoQA conversations that switch model every turn, resumable) and
`rarecache eval drift report`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RarecacheError
from .common import add_model_options


def register(ev) -> None:
    p = ev.add_parser("drift", help="drift over conversations that switch model every turn (CoQA, gold turns)",
                      description="CoQA stories read turn by turn with their gold answers, source and target "
                                  "taking turns, each switch handing off what the model has not seen; every "
                                  "turn's answer bits per byte against the model reading it all itself.")
    d = p.add_subparsers(dest="drift", required=True, metavar="ACTION")
    r = d.add_parser("run", help="run the arms over the stories (one JSON line per story, turn and arm; resumes)")
    r.add_argument("--source", required=True, help="model on odd turns (name, HF dir or .gguf)")
    r.add_argument("--target", required=True, help="model on even turns")
    r.add_argument("--map", required=True, type=Path, help="map fitted source -> target")
    r.add_argument("--reverse-map", type=Path, default=None,
                   help="map fitted target -> source (without it the source re-reads what it missed)")
    r.add_argument("--arms", nargs="+", default=["alone", "0.2:attn-source", "gate"],
                   help="alone, RHO:SELECTOR, gate (default: alone 0.2:attn-source gate)")
    r.add_argument("--gate-policy", type=Path, default=None, help="policy file for the gate arm (eval gate fit)")
    r.add_argument("--stories", type=int, default=200, help="evaluated CoQA stories (default: 200)")
    r.add_argument("--out", type=Path, required=True, help="results JSONL (appended to)")
    add_model_options(r)
    r.set_defaults(func=cmd_drift_run)
    q = d.add_parser("report", help="drift per arm and by turn; --summary writes it as JSON")
    q.add_argument("results", type=Path)
    q.add_argument("--summary", type=Path, default=None, help="write the figures here as JSON")
    q.set_defaults(func=cmd_drift_report)


def cmd_drift_run(args) -> int:
    from ..engine.llm import LLM
    from ..eval.drift import conversations, parse_arm, run_drift
    from ..transfer.gate import GatePolicy
    from ..transfer.mapper import Mapper

    if args.stories < 1:
        raise RarecacheError("--stories must be >= 1")
    for a in args.arms:
        parse_arm(a)  # before any model loads
    for m in (args.map, args.reverse_map, args.gate_policy):
        if m is not None and not m.is_file():
            raise RarecacheError(f"no file {m}")
    gate = GatePolicy.load(args.gate_policy) if args.gate_policy else None
    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    maps = {("source", "target"): Mapper.load(args.map)}
    if args.reverse_map:
        maps[("target", "source")] = Mapper.load(args.reverse_map)
    out = run_drift(conversations(args.cache_dir, args.stories), source, target, maps, args.arms, gate, args.out)
    print(_report(out))
    return 0


def _report(path: Path, summary: Path | None = None) -> str:
    from ..eval.drift import report

    table, figures = report(path)
    if summary is not None:
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {summary}", file=sys.stderr)
    return table


def cmd_drift_report(args) -> int:
    print(_report(args.results, args.summary))
    return 0
