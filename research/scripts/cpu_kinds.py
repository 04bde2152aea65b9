"""docs/artifacts/cpu-kinds.json (issue #55) from the committed records, never by hand: per CPU capability,
the dtype `auto` ran, the whole demo's wall time (`time rarecache demo`, its `real` line), the served handoff's
speed-up at T 2048 ρ 0.3 and ρ 1 against the 1.5B's prefill (the JSON line `bench handoff` prints last), and the
same for float32 where a float32 bench and demo were recorded. An entry for another capability already in the
file is kept (a kind measured on another machine).

    python research/scripts/cpu_kinds.py --bench docs/artifacts/bench-handoff-lengths.txt \
        --demo docs/artifacts/demo.txt --bench-float32 docs/artifacts/bench-handoff-float32.txt \
        --demo-float32 docs/artifacts/demo-float32.txt --out docs/artifacts/cpu-kinds.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def bench(path: Path) -> dict:
    """The bench's last JSON line: its header and the speed-ups at T 2048."""
    run = json.loads(path.read_text().strip().splitlines()[-1])
    at = {r["rho"]: r["speedup"] for r in run["rows"] if r["T"] == 2048 and r["batch"] == 1}
    return {"cpu": run["cpu"], "dtype": run["dtype"], "speedup_T2048_rho0.3": round(at[0.3], 2),
            "rho1_vs_prefill": round(at[1.0], 2)}


def demo_seconds(path: Path) -> float:
    """The `real` line `time` wrote after the demo."""
    m, s = re.search(r"^real\s+(\d+)m([\d.]+)s$", path.read_text(), re.M).groups()
    return round(60 * int(m) + float(s), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", type=Path, required=True)
    p.add_argument("--demo", type=Path, required=True)
    p.add_argument("--bench-float32", type=Path)
    p.add_argument("--demo-float32", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    kinds = json.loads(args.out.read_text()) if args.out.is_file() else {}
    entry = bench(args.bench)
    cpu = entry.pop("cpu")
    entry = {"dtype": entry.pop("dtype"), "demo_s": demo_seconds(args.demo), **entry,
             "records": [str(args.bench), str(args.demo)]}
    if args.bench_float32 and args.demo_float32:
        f32 = bench(args.bench_float32)
        if f32.pop("cpu") != cpu or f32.pop("dtype") != "float32":
            raise SystemExit(f"{args.bench_float32} is not a float32 bench on {cpu}")
        entry["float32"] = {"demo_s": demo_seconds(args.demo_float32), **f32}
        entry["records"] += [str(args.bench_float32), str(args.demo_float32)]
    kinds[cpu] = entry
    args.out.write_text(json.dumps(kinds, indent=1) + "\n")
    print(json.dumps({cpu: entry}))


if __name__ == "__main__":
    main()
