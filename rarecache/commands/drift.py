"""`rarecache eval drift run` (CoQA conversations that switch model every turn, resumable; in process,
or through a chat server with --server) and `rarecache eval drift report`."""

from __future__ import annotations

import json
import os
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
    r.add_argument("--source", required=True,
                   help="model on odd turns (name, HF dir or .gguf; with --server: its served name)")
    r.add_argument("--target", required=True, help="model on even turns (with --server: its served name)")
    r.add_argument("--map", type=Path, default=None, help="map fitted source -> target (required without --server)")
    r.add_argument("--reverse-map", type=Path, default=None,
                   help="map fitted target -> source (without it the source re-reads what it missed)")
    r.add_argument("--arms", nargs="+", default=["alone", "0.2:attn-source", "gate"],
                   help="alone, RHO:SELECTOR, gate; a switching arm ending :heal (0.2:suffix:heal, gate:heal) makes "
                        "the answering model's rows its own again after each answer (default: alone 0.2:attn-source "
                        "gate)")
    r.add_argument("--gate-policy", type=Path, default=None, help="policy file for the gate arm (eval gate fit)")
    r.add_argument("--stories", type=int, default=200, help="evaluated CoQA stories (default: 200)")
    r.add_argument("--out", type=Path, required=True, help="results JSONL (appended to)")
    r.add_argument("--server", default=None, metavar="URL",
                   help="send the turns to this chat server (rarecache serve, e.g. http://127.0.0.1:8000) instead: "
                        "each turn's gold answer is scored there (continue_final_message, prompt_logprobs) and the "
                        "server hands off between its models, each request with its arm's budget (the gate arm needs "
                        "a server started with --rho auto). Rows say \"via\": \"server\"")
    r.add_argument("--api-key", default=None,
                   help="with --server: sent as Authorization: Bearer KEY (default: $RARECACHE_API_KEY, else none)")
    add_model_options(r)
    r.set_defaults(func=cmd_drift_run)
    q = d.add_parser("report", help="drift per arm and by turn; --summary writes it as JSON")
    q.add_argument("results", type=Path)
    q.add_argument("--summary", type=Path, default=None, help="write the figures here as JSON")
    q.set_defaults(func=cmd_drift_report)


def cmd_drift_run(args) -> int:
    from ..engine.llm import LLM
    from ..eval.drift import conversations, drift_meta, parse_arm, run_drift
    from ..eval.results import models_meta
    from ..transfer.gate.policy import GatePolicy
    from ..transfer.mapper import Mapper

    if args.stories < 1:
        raise RarecacheError("--stories must be >= 1")
    for a in args.arms:
        parse_arm(a)  # before any model loads
    if args.server is not None:
        return _run_on_server(args)
    if args.api_key is not None:
        raise RarecacheError("--api-key goes with --server")
    if args.map is None:
        raise RarecacheError("give --map (the map fitted source -> target), or --server URL")
    for m in (args.map, args.reverse_map, args.gate_policy):
        if m is not None and not m.is_file():
            raise RarecacheError(f"no file {m}")
    gate = GatePolicy.load(args.gate_policy) if args.gate_policy else None
    source, target = (LLM(m, dtype=args.dtype, cache_dir=args.cache_dir) for m in (args.source, args.target))
    maps = {("source", "target"): Mapper.load(args.map)}
    paths = {"source->target": args.map}
    if args.reverse_map:
        maps[("target", "source")] = Mapper.load(args.reverse_map)
        paths["target->source"] = args.reverse_map
    meta = drift_meta(models_meta(source, target, paths, args.dtype), args.reverse_map is not None, args.arms, gate)
    out = run_drift(conversations(args.cache_dir, args.stories), source, target, maps, args.arms, gate, args.out,
                    meta=meta)
    print(_report(out))
    return 0


def _run_on_server(args) -> int:
    from ..eval.drift import conversations
    from ..eval.drift_server import DriftServer, run_drift_server

    given = [flag for flag, value in (("--map", args.map), ("--reverse-map", args.reverse_map),
                                      ("--gate-policy", args.gate_policy)) if value is not None]
    if given:
        raise RarecacheError(f"{', '.join(given)}: with --server the server's maps and gate policy are used "
                             "(give them to rarecache serve)")
    if not args.server.startswith(("http://", "https://")):
        raise RarecacheError(f"--server takes an http:// or https:// URL, got {args.server!r}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("RARECACHE_API_KEY")
    if api_key is not None and not api_key.strip():
        raise RarecacheError("--api-key (or $RARECACHE_API_KEY) is empty")
    server = DriftServer(args.server, args.source, args.target, api_key)
    out = run_drift_server(conversations(args.cache_dir, args.stories), server, args.arms, args.out)
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
