"""How well each feature a ladder records separates a changed answer (the rung's answer differs
from the target's by eval/answers.py's rule, a tie its own answer; for bits per byte, the rung's bpb
moved more than eval.gate_report.CHANGED_BPB from the target's, as `eval gate` counts it), as ROC AUC over
(item, rung) pairs with a bootstrap CI over items, plus a logistic model of all of them cross-validated
over items. Exploration of which signal the gate should read (research/LOG.md 9).

    python research/scripts/gate_signals.py RESULTS.jsonl[.gz] [ARM] [--only-with FEATURE] [--per-rung]

`--only-with js_views`: only the items whose every rung records FEATURE (a file continued by a later
version of the ladder, e.g. held items 350-399 recorded with js_views after 300-349 without).
`--per-rung`: each feature's AUC within each rung too. Pooled over rungs, a feature that only tracks ρ
(lower rungs change more answers and leave more score mass outside) scores above chance without telling
one request from another; within a rung it cannot.
"""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np

from rarecache.eval.answers import same_answer
from rarecache.eval.gate_report import CHANGED_BPB, auc, auc_ci
from rarecache.eval.tasks import TASKS

FEATURES = ["js", "js_plain", "outside", "entropy", "margin", "row_error", "js_source", "choice_margin", "js_views", "answer_views"]
NEGATED = {"margin", "choice_margin"}  # a wide margin means a settled answer
LOGGED = {"js", "js_plain", "row_error", "js_source", "js_views", "answer_views"}  # those the ladders record are read


def ladders(path: str, arm: str | None, only_with: str | None = None):
    rows = [json.loads(line) for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
    metric = TASKS[rows[0]["task"]].metric
    bpb = metric == "bpb"
    target = {r["item"]: r for r in rows if r["arm"] == "target"}
    # bits per byte: moved past CHANGED_BPB; an answer: eval/answers.py's one rule (a tie is its own answer)
    changed = ((lambda a, t: abs(a["bpb"] - t["bpb"]) > CHANGED_BPB) if bpb
               else (lambda a, t: not same_answer(a, t, metric)))
    lads = [r for r in rows if r["arm"].startswith("ladder/") and (arm is None or r["arm"] == arm)
            and r["item"] in target and (only_with is None or all(only_with in g for g in r["ladder"]))]
    if len({r["arm"] for r in lads}) != 1:
        sys.exit(f"need exactly one ladder arm with target rows, found {sorted({r['arm'] for r in lads})}")
    for r in lads:  # the answer's own margin: the best choice's log-likelihood over the second's (unnormalised)
        for rung in r["ladder"]:
            if len(rung.get("logprobs", ())) >= 2:
                top = sorted(rung["logprobs"], reverse=True)
                rung["choice_margin"] = top[0] - top[1]
    # those every rung of every record has (row_error, js_source: ladders from 2026-12-03 on; js_views: from
    # 2026-12-04, through maps with two views)
    FEATURES[:] = [f for f in FEATURES if all(f in g for r in lads for g in r["ladder"])]
    return [([[rung[f] for f in FEATURES] + [rung["rho"]] for rung in r["ladder"]],
             [changed(rung, target[r["item"]]) for rung in r["ladder"]]) for r in lads], lads[0]["arm"]


def logistic_cv(per_item, folds: int = 5, lam: float = 1.0, seed: int = 0) -> float:
    """Out-of-fold scores of a ridge-penalised logistic model (standardised features, log divergences)."""
    X = np.array([x for xs, _ in per_item for x in xs], dtype=float)
    y = np.array([c for _, cs in per_item for c in cs], dtype=float)
    item = np.repeat(np.arange(len(per_item)), [len(cs) for _, cs in per_item])
    logs = [k for k, f in enumerate(FEATURES) if f in LOGGED]  # divergences and errors span decades
    X[:, logs] = np.log(X[:, logs] + 1e-9)
    X = (X - X.mean(0)) / (X.std(0) + 1e-9)
    Xb = np.c_[np.ones(len(X)), X]
    order = np.random.default_rng(seed).permutation(len(per_item))
    out = np.zeros(len(y))
    for held in np.array_split(order, folds):
        test = np.isin(item, held)
        w = np.zeros(Xb.shape[1])
        pen = lam * np.eye(len(w))
        pen[0, 0] = 0.0  # the intercept is not penalised
        for _ in range(50):  # Newton steps
            p = 1 / (1 + np.exp(-Xb[~test] @ w))
            H = Xb[~test].T @ (Xb[~test] * (p * (1 - p))[:, None]) + pen
            w -= np.linalg.solve(H, Xb[~test].T @ (p - y[~test]) + pen @ w)
        out[test] = Xb[test] @ w
    return auc(out.tolist(), y.astype(bool).tolist())


def main() -> None:
    argv, only_with = sys.argv[1:], None
    per_rung = "--per-rung" in argv
    argv = [a for a in argv if a != "--per-rung"]
    if "--only-with" in argv:
        k = argv.index("--only-with")
        if k + 1 >= len(argv):
            sys.exit(__doc__)
        only_with = argv[k + 1]
        del argv[k : k + 2]
    if len(argv) not in (1, 2) or any(a.startswith("--") for a in argv):
        sys.exit(__doc__)
    per_item, arm = ladders(argv[0], argv[1] if len(argv) == 2 else None, only_with)
    changed = sum(c for _, cs in per_item for c in cs)
    pairs = sum(len(cs) for _, cs in per_item)
    print(f"{arm}: {len(per_item)} items, {pairs} (item, rung) pairs, {changed} with a changed answer")
    for k, name in enumerate(FEATURES):
        sign = -1 if name in NEGATED else 1
        a, lo, hi = auc_ci([([sign * x[k] for x in xs], cs) for xs, cs in per_item])
        print(f"  {'-' if sign < 0 else ' '}{name:9s} AUC {a:.3f} ({lo:.3f}-{hi:.3f})")
        if per_rung:
            if len({tuple(x[-1] for x in xs) for xs, _ in per_item}) != 1:
                sys.exit("--per-rung needs every item's ladder on the same rungs")
            for r in range(len(per_item[0][0])):
                a, lo, hi = auc_ci([([sign * xs[r][k]], [cs[r]]) for xs, cs in per_item])
                print(f"      rung {r + 1} (rho {per_item[0][0][r][-1]:g}, {sum(cs[r] for _, cs in per_item)} changed): "
                      f"AUC {a:.3f} ({lo:.3f}-{hi:.3f})")
    a, lo, hi = auc_ci([([-x[-1] for x in xs], cs) for xs, cs in per_item])  # the baseline a pooled AUC must beat
    print(f"  -rho       AUC {a:.3f} ({lo:.3f}-{hi:.3f})  (the rung alone: lower rungs change more answers)")
    print(f"  logistic of all, {5}-fold over items: AUC {logistic_cv(per_item):.3f}")


if __name__ == "__main__":
    main()
