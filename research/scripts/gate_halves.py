"""Each signal's AUC for a changed answer within each rung, on the two halves of a held-apart ladder file
apart: a signal found on the first half counts only if the second half shows it too (research/LOG.md §12).

    python research/scripts/gate_halves.py RUNS/eval/held-TASK.jsonl ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from rarecache.eval.gate_report import read_ladders
from rarecache.eval.gate_auc import signal_aucs

SHOWN = ("nll", "nll_gap", "nll_shift", "probe_cos", "row_error", "js", "js_views", "answer_views", "margin",
         "outside", "combined")

for path in sys.argv[1:]:
    lad = read_ladders(Path(path))
    n = len(lad.rows)
    for name, part in (("first half", slice(0, n // 2)), ("second half", slice(n // 2, n))):
        table = signal_aucs(lad.rows[part], lad.changed[part], lad.rungs)
        some = next(iter(table["rungs"].values()))
        changed = "  ".join(f"{rho}: {c['js']['changed']}" for rho, c in table["rungs"].items())
        print(f"{lad.task}, {name} of {n} items (changed per rung: {changed})")
        for s in SHOWN:
            if s in some:
                cells = "  ".join("-" if c[s]["auc"] is None else
                                  f"{rho}: {c[s]['auc']:.3f} ({c[s]['ci'][0]:.3f}-{c[s]['ci'][1]:.3f})"
                                  for rho, c in table["rungs"].items())
                print(f"  {s:12s} {cells}")
