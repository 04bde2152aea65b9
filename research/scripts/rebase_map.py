"""Move committed partial runs onto a recalibrated map, with the evidence that it is the same map.

A calibration is deterministic on one machine but not across CPUs: the same command on another instruction
set (AVX2 vs AVX-512) rounds the forward passes differently, so the map's bytes and sha256 differ. A results
file's meta pins its map's sha256 and a run refuses to continue through another map, so a lost map would
otherwise cost every run through it. This rewrites the meta of committed runs (docs/artifacts/NAME.meta.json)
to the recalibrated map and keeps the old one under "maps_replaced" with the evidence (a file comparing the
two maps' records on re-evaluated items), so the change is visible in every report made from them.
  python research/scripts/rebase_map.py LABEL NEW_MAP EVIDENCE NAME.meta.json...
"""

import json
import sys
from pathlib import Path

from rarecache.packages import sha256_file

label, new_map, evidence, metas = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
new_sha = sha256_file(new_map)
for path in map(Path, metas):
    meta = json.loads(path.read_text())
    old = meta["maps"][label]
    if old["sha256"] == new_sha:
        print(f"{path}: already on {new_sha[:16]}")
        continue
    meta.setdefault("maps_replaced", []).append({"label": label, "old": old, "new_sha256": new_sha,
                                                 "evidence": str(evidence)})
    meta["maps"][label] = {"file": old["file"], "sha256": new_sha}
    path.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{path}: {label} {old['sha256'][:16]} -> {new_sha[:16]}")
