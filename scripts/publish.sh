#!/usr/bin/env bash
# Copy an evaluation run into docs/artifacts: every complete record (a run still going may be writing its
# last line; an item it is in the middle of counts in the arms it has), gzipped, with its timings and its
# .meta.json, the full report, the compact table and the plots. Reports are made from a copy at the same
# relative path, so their headers name runs/eval/NAME.jsonl. results.sh and general.sh seed a later run from
# what this commits (lib.sh).
#   bash scripts/publish.sh runs/eval/gsm8k_bpb-300.jsonl [NAME]   (NAME: the artifacts' name, e.g. general-mmlu-100)
set -euo pipefail
cd "$(dirname "$0")/.."
src=$1; name=${2:-$(basename "${src%.jsonl}")}; art=$PWD/docs/artifacts
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/runs/eval"
python - "${src%.jsonl}" "$tmp/runs/eval/$name" <<'PY'
import json, os, sys
src, dst = sys.argv[1], sys.argv[2]
for part in (".jsonl", ".timings.jsonl"):
    if not os.path.isfile(src + part):
        continue
    keep = []
    for line in open(src + part):
        try:  # a line the running evaluation is still writing is left out; it resumes from the rest
            json.loads(line)
        except ValueError:
            continue
        keep.append(line if line.endswith("\n") else line + "\n")
    open(dst + part, "w").writelines(keep)
    print(f"{os.path.basename(dst)}{part}: {len(keep)} records", file=sys.stderr)
PY
cp "${src%.jsonl}.meta.json" "$tmp/runs/eval/$name.meta.json"
gzip -n -c "$tmp/runs/eval/$name.jsonl" > "$art/$name.jsonl.gz"
t=$tmp/runs/eval/$name.timings.jsonl
[ ! -f "$t" ] || gzip -n -c "$t" > "$art/$name.timings.jsonl.gz"
cp "$tmp/runs/eval/$name.meta.json" "$art/$name.meta.json"
(cd "$tmp" && rarecache eval report "runs/eval/$name.jsonl" --plots "$art" > "$art/$name.report.md" \
    && rarecache eval report "runs/eval/$name.jsonl" --compact > "$art/$name.compact.md")
head -1 "$art/$name.report.md"
