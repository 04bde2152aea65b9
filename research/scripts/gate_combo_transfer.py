"""Issue #44: does a combination of the signals a server can compute, fitted on the held-apart ladders
(items 300-499), tell which of the evaluated items' (0-99) answers a rung changes, within each rung?
The combination the gate fit prints is cross-validated within one file, over every signal (answer_views,
which needs the answer choices, among them); this one is fitted per task on the held items alone, on the
servable signals only, and scored on the evaluated items it never saw. Prints, per task and rung, the AUC
with its interval (items resampled).
  python research/scripts/gate_combo_transfer.py
"""

import sys
from pathlib import Path

import numpy as np

from rarecache.eval.gate_report import read_ladders
from rarecache.eval.gate_auc import SIGNALS, auc_ci, logistic

SERVABLE = [s for s in SIGNALS if s != "answer_views"]  # every other one reads the prompt and the models only
G = Path("research/gate")


def features(lad, names):
    x = np.array([[SIGNALS[s] * float(g[s]) for s in names] for r in lad.rows for g in r])
    y = np.array([c for cs in lad.changed for c in cs], dtype=float)
    return x, y


def main(tasks=("mmlu", "arc_challenge", "hellaswag")):
    print("| task | signals | " + " | ".join(f"rho {r}" for r in (0.1, 0.2, 0.3, 0.5)) + " | pooled |")
    print("|---" * 7 + "|")
    for task in tasks:
        held = read_ladders(G / f"held-{task}-200.jsonl.gz", signal="nll")
        ev = read_ladders(G / f"eval-{task}-100.jsonl.gz", signal="nll")
        names = [s for s in SERVABLE if all(s in g for lad in (held, ev) for r in lad.rows for g in r)]
        for label, use in (("combined (servable)", names), ("nll", ["nll"])):
            xh, yh = features(held, use)
            mu, sd = xh.mean(0), xh.std(0)
            sd[sd == 0] = 1.0
            w = logistic((xh - mu) / sd, yh)
            score = lambda lad: [[float(((np.array([SIGNALS[s] * float(g[s]) for s in use]) - mu) / sd) @ w[:-1])  # noqa
                                  for g in r] for r in lad.rows]
            sc = score(ev)
            cells = []
            for k in range(len(ev.rungs)):
                a, lo, hi = auc_ci([([sc[i][k]], [ev.changed[i][k]]) for i in range(len(sc))])
                n = sum(ev.changed[i][k] for i in range(len(sc)))
                cells.append(f"{a:.2f} ({lo:.2f}–{hi:.2f}; {n} changed)")
            a, lo, hi = auc_ci([(sc[i], ev.changed[i]) for i in range(len(sc))])
            print(f"| {task} | {label} | " + " | ".join(cells) + f" | {a:.2f} ({lo:.2f}–{hi:.2f}) |")
    print(f"\nservable signals: {', '.join(names)}", file=sys.stderr)


if __name__ == "__main__":
    main()
