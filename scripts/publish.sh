#!/usr/bin/env bash
# Copy an evaluation run into docs/artifacts: its complete items only (a run still going may have a
# partly written last item), gzipped, with its .meta.json, the full report, the compact table and
# the plots. Reports are made from a copy at the same relative path, so their headers name
# runs/eval/NAME.jsonl. results.sh seeds a later run from what this commits.
#   bash scripts/publish.sh runs/eval/gsm8k_bpb-300.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
src=$1; name=$(basename "${src%.jsonl}"); art=$PWD/docs/artifacts
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/runs/eval"
python - "$src" "$tmp/runs/eval/$name.jsonl" <<'PY'
import json, sys
from collections import Counter
lines = [l for l in open(sys.argv[1]) if l.strip()]
items = Counter(json.loads(l)["item"] for l in lines)
arms = max(items.values())
keep = [l for l in lines if items[json.loads(l)["item"]] == arms]
open(sys.argv[2], "w").writelines(keep)
print(f"{len(keep) // arms} complete items of {arms} arms ({len(items)} started)", file=sys.stderr)
PY
cp "${src%.jsonl}.meta.json" "$tmp/runs/eval/$name.meta.json"
gzip -n -c "$tmp/runs/eval/$name.jsonl" > "$art/$name.jsonl.gz"
cp "$tmp/runs/eval/$name.meta.json" "$art/$name.meta.json"
(cd "$tmp" && rarecache eval report "runs/eval/$name.jsonl" --plots "$art" > "$art/$name.report.md" \
    && rarecache eval report "runs/eval/$name.jsonl" --compact > "$art/$name.compact.md")
head -1 "$art/$name.report.md"
