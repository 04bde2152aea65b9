"""Merge results files of one task into one, so that `rarecache eval report` reads arms run apart side by side (a new
map's arms beside the committed target, source and served rows of the same items).

The files must agree on what makes rows comparable (task, its items' sha256, models, dtype, seed); their maps are
united and a label naming two different files is refused. A row (item, arm) present in several files must be the
same row. Items and arms are kept in the order first met; --items START:END keeps only those item indices, --arms
only those arms (the maps they name stay in the meta).

    python research/scripts/merge_runs.py OUT.jsonl A.jsonl[.gz] B.jsonl[.gz] ... [--items 0:100] [--arms A B ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rarecache.eval.results import load_results, results_stem, run_record, sibling

SAME = ("task", "task_file", "source", "target", "dtype", "seed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("inputs", type=Path, nargs="+")
    p.add_argument("--items", default=None, help="START:END item indices to keep (default: all)")
    p.add_argument("--arms", nargs="+", default=None, help="arms to keep (default: all)")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.items.split(":")) if args.items else (0, 10 ** 9)
    meta, rows, timings = None, {}, {}
    for path in args.inputs:
        m = run_record(path)
        if not m:
            sys.exit(f"{path}: no run record beside it ({results_stem(path)}.meta.json)")
        if meta is None:
            meta = m
        else:
            for key in SAME:
                if m.get(key) != meta.get(key):
                    sys.exit(f"{path}: its {key} differs from {args.inputs[0]}'s")
            for label, info in m["maps"].items():
                if meta["maps"].setdefault(label, info)["sha256"] != info["sha256"]:
                    sys.exit(f"{path}: map label {label} names another file than in the files before it")
        for into, part in ((rows, path), (timings, sibling(path, ".timings.jsonl"))):
            for r in load_results(part) if part.is_file() else []:
                if not lo <= int(r["item"].rsplit("-", 1)[1]) < hi or args.arms and r["arm"] not in args.arms:
                    continue
                key = (r["item"], r["arm"])
                if into is rows and key in into and into[key] != r:
                    sys.exit(f"{path}: row {key} differs from an earlier file's")
                into.setdefault(key, r)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows.values())
    with open(sibling(args.out, ".timings.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in timings.values())
    json.dump(meta, open(sibling(args.out, ".meta.json"), "w"), indent=1)
    print(f"{len(rows)} rows of {len({k[0] for k in rows})} items, arms: {sorted({k[1] for k in rows})}")


if __name__ == "__main__":
    main()
