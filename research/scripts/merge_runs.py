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
import gzip
import json
import sys
from pathlib import Path

SAME = ("task", "task_file", "source", "target", "dtype", "seed")


def stem(path: Path) -> str:
    name = str(path)
    for ext in (".jsonl.gz", ".jsonl"):
        if name.endswith(ext):
            return name[: -len(ext)]
    sys.exit(f"{path}: not a results file (.jsonl or .jsonl.gz)")


def read(path: str) -> list[dict]:
    for name in (path + ".gz", path) if not path.endswith(".gz") else (path,):
        if Path(name).is_file():
            opener = gzip.open if name.endswith(".gz") else open
            with opener(name, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    return []


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
        s = stem(path)
        m = json.load(open(s + ".meta.json"))
        if meta is None:
            meta = m
        else:
            for key in SAME:
                if m.get(key) != meta.get(key):
                    sys.exit(f"{path}: its {key} differs from {args.inputs[0]}'s")
            for label, info in m["maps"].items():
                if meta["maps"].setdefault(label, info)["sha256"] != info["sha256"]:
                    sys.exit(f"{path}: map label {label} names another file than in the files before it")
        for kind, into in (("", rows), (".timings", timings)):
            for r in read(s + kind + ".jsonl"):
                if not lo <= int(r["item"].rsplit("-", 1)[1]) < hi or args.arms and r["arm"] not in args.arms:
                    continue
                key = (r["item"], r["arm"])
                if kind == "" and key in into and into[key] != r:
                    sys.exit(f"{path}: row {key} differs from an earlier file's")
                into.setdefault(key, r)
    o = stem(args.out)
    with open(o + ".jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows.values())
    with open(o + ".timings.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in timings.values())
    json.dump(meta, open(o + ".meta.json", "w"), indent=1)
    print(f"{len(rows)} rows of {len({k[0] for k in rows})} items, arms: {sorted({k[1] for k in rows})}")


if __name__ == "__main__":
    main()
