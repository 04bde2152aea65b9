"""How often do the 1.5B's own answers move under a perturbation that changes nothing but rounding?

Issue #41 asks a handoff to keep the target's MMLU answer on 85% of items. The 1.5B's distribution over the
four letters is often flat (top-two margin under 0.5 nats on 46% of items, research/LOG.md §16), so any
perturbation moves some answers. This reads the target's answers from a reference file (bf16, the
evaluations' dtype) and compares other runs' arms with them (the 1.5B in float32; handoffs at larger budgets):
agreement, Cohen's κ, and agreement by the reference's own margin, so a handoff's figure can be read against
what rounding alone does.

    python research/scripts/agreement_ceiling.py research/fidelity/adopt/mmlu.jsonl.gz \
        RUNS/ceiling/mmlu-fp32.jsonl:target:1.5B-float32 RUNS/ceiling/mmlu-curve.jsonl:rho=0.5/suffix@v4:suffix-0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rarecache.eval.report import agreement, kappa
from rarecache.eval.results import load_results

BANDS = ((0.0, 0.5), (0.5, 2.0), (2.0, float("inf")))  # the reference's top-two margin, nats


def margin(logprobs: list[float]) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="results file whose `target` arm is the reference")
    ap.add_argument("others", nargs="+", metavar="FILE:ARM:NAME", help="an arm of another results file")
    args = ap.parse_args()
    ref = [r for r in load_results(Path(args.reference)) if r["arm"] == "target"]
    margins = {r["item"]: margin(r["logprobs"]) for r in ref}
    print(f"reference: the target arm of {args.reference}, {len(ref)} items; top-two margin bands (nats): "
          + ", ".join(f"[{lo}, {hi}) {sum(lo <= m < hi for m in margins.values())}" for lo, hi in BANDS))
    head = ["arm", "n", "accuracy", "agreement", "κ"] + [f"agreement, margin [{lo}, {hi})" for lo, hi in BANDS]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for spec in args.others:
        path, arm, name = spec.rsplit(":", 2)
        rows = [dict(r, arm=name) for r in load_results(Path(path)) if r["arm"] == arm and r["item"] in margins]
        if not rows:
            print(f"no rows of arm {arm} in {path} on the reference's items", file=sys.stderr)
            return 1
        both = ref + rows
        share, n = agreement(both, name, "correct")
        cells = [name, str(n), f"{sum(r['correct'] for r in rows) / len(rows):.1%}", f"{share:.1%}",
                 f"{kappa(both, name, 'correct'):.2f}"]
        for lo, hi in BANDS:
            band = {i for i, m in margins.items() if lo <= m < hi}
            s, k = agreement(both, name, "correct", band)
            cells.append(f"{s:.0%} ({k})" if k else "—")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
