"""The best any gate could do on the recorded ladders: a perfect signal, read off the answers themselves.

Criterion 2 of the gate issue (mean recomputed share ≤ 0.3, fallbacks counted as 1.0) asks for cheap accepted
requests; criterion 1 asks that they keep the target's answers. A signal can only choose among the rungs the
ladder offers, so the cheapest policy that keeps every answer is an oracle that knows, per request, the lowest
rung whose answer the target would have given anyway (multiple choice: the same answer; bits per byte: moved by
at most the gate's 0.01) and falls back where no rung up to the cap does. `--loss accuracy` lets the oracle
accept any rung that is not worse (a change between two wrong answers, or an improvement, is free), the looser
bound. If even the oracle recomputes more than 0.3 of a task's positions, no signal can meet criterion 2 there
with this map, selector and ladder; if it does not, what is missing is the signal (criterion 3).

    python scripts/gate_oracle.py ~/.cache/rarecache/runs/eval/ridge-{mmlu,arc_challenge,hellaswag,gsm8k_bpb}.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rarecache.eval.gate import CHANGED_BPB, read_ladders
from rarecache.eval.metrics import paired_diff_ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="results files with a target arm and one ladder arm")
    ap.add_argument("--arm", default=None, help="the ladder arm (default: the file's only one)")
    ap.add_argument("--caps", type=float, nargs="+", default=[0.3, 0.5], help="largest ρ accepted (default: 0.3 0.5)")
    ap.add_argument("--loss", choices=["changed", "accuracy"], default="changed",
                    help="changed: keep the target's answer; accuracy: be no worse than it (default: changed)")
    args = ap.parse_args()
    print(f"oracle: {args.loss}")
    print("| file | n | cap ρ | Δ vs target (95% CI) | fell back | recomputed (fallback = 1) | accepted at rung ρ |")
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        lad = read_ladders(path, args.arm)
        bpb = lad.metric == "bpb"

        def keeps(k: int, r: int) -> bool:
            if args.loss == "changed":
                return not lad.changed[k][r]
            worse = lad.value[k][r] - lad.target[k]  # bpb: higher is worse; accuracy: lower is worse
            return worse <= CHANGED_BPB if bpb else worse >= 0

        for cap in args.caps:
            got, cost, fell, where = [], [], 0, []
            for k in range(len(lad.items)):
                rung = next((r for r, rho in enumerate(lad.rungs) if rho <= cap + 1e-9 and keeps(k, r)), None)
                if rung is None:
                    got.append(lad.target[k])
                    cost.append(1.0)
                    fell += 1
                else:
                    got.append(lad.value[k][rung])
                    cost.append(lad.cost[k][rung])
                    where.append(lad.rungs[rung])
            d, lo, hi = paired_diff_ci(got, lad.target)[:3]
            scale, unit, fmt = (1, "bpb", "{:+.4f}") if bpb else (100, "pp", "{:+.1f}")
            delta = f"{fmt.format(d * scale)} ({fmt.format(lo * scale)}, {fmt.format(hi * scale)}) {unit}"
            hist = " ".join(f"{rho:g}: {where.count(rho)}" for rho in lad.rungs if rho <= cap + 1e-9)
            print(f"| {path.name} | {len(lad.items)} | {cap:g} | {delta} | {fell / len(lad.items):.0%} | "
                  f"{sum(cost) / len(cost):.3f} | {hist} |")


if __name__ == "__main__":
    main()
