"""How well the fidelity probe's ranking of maps predicts their ranking on the tasks (issue #41 item 1: the probe
is only useful if it does). Reads the screen files (`eval report --general-summary`-style JSON with a `probe`
and a `previous` map), collects every map once by sha256, and prints each map's probe KL (suffix at 0.2) beside
its tasks, then Spearman's rank correlation of the probe KL (lower is better) with each task's agreement and
with passage-QA bpb, over the maps. With four maps a correlation is a direction, not an estimate.

    python research/scripts/probe_rank.py research/fidelity/screen-v*-100.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

maps: dict[str, dict] = {}
for path in sys.argv[1:]:
    d = json.load(open(path))
    for entry, kl in ((d, d["probe"]["kl"]), (d.get("previous") or {}, d["probe"].get("previous_kl"))):
        if entry and kl is not None:
            maps.setdefault(entry["map"], {"kl": kl, "tasks": entry["tasks"], "seen_in": path})


def ranks(x):
    """Ranks from 0, ties sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def spearman(a, b) -> float:
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


names = sorted(maps, key=lambda m: maps[m]["kl"])
tasks = ["mmlu", "arc_challenge", "hellaswag"]
print("| map | probe KL (bits) | " + " | ".join(f"{t} agreement" for t in tasks) + " | mean agreement | passage QA bpb |")
print("|---|---|" + "---|" * (len(tasks) + 2))
rows = []
for m in names:
    t = maps[m]["tasks"]
    agree = [t[k]["agreement"] for k in tasks]
    rows.append((maps[m]["kl"], *agree, float(np.mean(agree)), t["coqa_passage"]["handoff"]))
    print(f"| {m[:12]} | {maps[m]['kl']:.3f} | " + " | ".join(f"{a:.2f}" for a in agree)
          + f" | {np.mean(agree):.3f} | {t['coqa_passage']['handoff']:.3f} |")
r = np.array(rows)
print(f"\nSpearman over {len(r)} maps, probe KL against (a good probe: negative for agreement, positive for bpb):")
for i, name in enumerate([*tasks, "mean agreement", "passage QA bpb"], start=1):
    print(f"  {name}: {spearman(r[:, 0], r[:, i]):+.2f}")
