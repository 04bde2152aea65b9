"""The best any gate could do on the recorded ladders: a perfect signal, read off the answers themselves.

Criterion 2 of the gate issue (mean recomputed share ≤ 0.3, fallbacks counted as 1.0) asks for cheap accepted
requests; criterion 1 asks that they keep the target's answers. A signal can only choose among the rungs the
ladder offers, so the cheapest policy that keeps every answer is an oracle that knows, per request, the lowest
rung whose answer the target would have given anyway (multiple choice: the same answer; bits per byte: moved by
at most CHANGED_BPB, 0.01) and falls back where no rung up to the cap does. `--loss accuracy` lets the oracle
accept any rung that is not worse (a change between two wrong answers, or an improvement, is free), the looser
bound. If even the oracle recomputes more than 0.3 of a task's positions, no signal that keeps every answer can meet
criterion 2 there with this map, selector and ladder; if it does not, what is missing is the signal (criterion 3).

    python research/scripts/gate_oracle.py ~/.cache/rarecache/runs/eval/ridge-{mmlu,arc_challenge,hellaswag,gsm8k_bpb}.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rarecache.eval.gate_report import LOSSES, oracle, read_ladders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="results files with a target arm and one ladder arm")
    ap.add_argument("--arm", default=None, help="the ladder arm (default: the file's only one)")
    ap.add_argument("--caps", type=float, nargs="+", default=[0.3, 0.5], help="largest ρ accepted (default: 0.3 0.5)")
    ap.add_argument("--loss", choices=LOSSES, default="changed",
                    help="changed: keep the target's answer; accuracy: be no worse than it (default: changed)")
    args = ap.parse_args()
    print(f"oracle: {args.loss}")
    print("| file | n | cap ρ | Δ vs target (95% CI) | fell back | recomputed (fallback = 1) | accepted at rung ρ |")
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        lad = read_ladders(path, args.arm)
        for cap in args.caps:
            o = oracle(lad, cap, args.loss)
            fmt = "{:+.4f}" if o["unit"] == "bpb" else "{:+.1f}"
            delta = f"{fmt.format(o['delta'])} ({fmt.format(o['ci'][0])}, {fmt.format(o['ci'][1])}) {o['unit']}"
            hist = " ".join(f"{rho:g}: {k}" for rho, k in o["accepted"].items())
            print(f"| {path.name} | {o['n']} | {cap:g} | {delta} | {o['fallback_share']:.0%} | "
                  f"{o['mean_recomputed_share']:.3f} | {hist} |")


if __name__ == "__main__":
    main()
