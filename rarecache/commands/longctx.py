"""`rarecache eval longctx-summary`: the long-context suite's summary (eval/longctx_summary.py) from results files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..defaults import SERVED
from ..errors import RarecacheError

DESCRIPTION = f"""\
Summarise the long-context suite at the served handoff: per task and length (<task>@<T>, from
the rows), the 1.5B alone (target), the 0.5B alone (source) and the handoff (served) on the
items all three answered, as fractions 0-1 of the task's metric; agreement with the target's
own answers; delta = served - target with its paired bootstrap 95% interval. speedup_T2048
comes from --bench (rarecache bench handoff --out at T {2048}, batch 1, the served rho and
selector). Refuses a missing task or length (every task at 2048; retrieval and multidoc_qa at
4096), a missing arm, or a map that differs between the files, unless --partial."""


def register(ev) -> None:
    p = ev.add_parser("longctx-summary", help="the long-context suite's summary JSON from its results files",
                      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+",
                   help="results JSONL files of eval run --task TASK --length T, one per task and length")
    p.add_argument("--bench", type=Path, required=True, help="bench handoff JSON (--out), or JSON lines of its rows")
    p.add_argument("--arm", default=f"{SERVED.rho:g}:{SERVED.selector}", metavar="RHO:SELECTOR",
                   help=f"the served handoff (default: {SERVED.rho:g}:{SERVED.selector}, the served default)")
    p.add_argument("--map-label", default=None,
                   help="the served map's label in the records (default: the one map every file records)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the JSON (default: $RARECACHE_HOME/results/longctx-summary.json; the "
                        "committed one is docs/artifacts/longctx-summary.json)")
    p.add_argument("--partial", action="store_true",
                   help="write what the files hold and list the missing tasks instead of refusing")
    p.set_defaults(func=cmd_longctx_summary)


def cmd_longctx_summary(args) -> int:
    from ..eval.longctx_summary import longctx_summary, markdown
    from ..packages import results_path

    for path in [*args.results, args.bench]:
        if not path.is_file():
            raise RarecacheError(f"no such file {path}")
    summary = longctx_summary(args.results, args.arm, args.map_label, args.bench, args.partial)
    print(markdown(summary))
    out = args.out or results_path("longctx-summary.json", getattr(args, "cache_dir", None))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0
