#!/usr/bin/env bash
# Copy an evaluation run into docs/artifacts: every complete record (a run still going may be writing its
# last line; an item it is in the middle of counts in the arms it has), gzipped, with its timings and its
# .meta.json, the full report, the compact table and the plots. Reports are made from a copy at the same
# relative path, so their headers name runs/eval/NAME.jsonl. results.sh and general.sh seed a later run from
# what this commits (lib.sh).
#   bash research/scripts/publish.sh runs/eval/gsm8k_bpb-300.jsonl [NAME]   (NAME: the artifacts' name, e.g. general-mmlu-100)
# ART=DIR publishes into DIR instead (research/fidelity/runs for screens of candidate maps).
# LABELS=v3,... publishes only the arms through those map labels and the map-free ones (target, source), and
# records only those maps: one map's arms out of a results file several maps share (general_v3.sh step 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$1; name=${2:-$(basename "${src%.jsonl}")}; art=${ART:-$PWD/docs/artifacts}; mkdir -p "$art"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/runs/eval"
python - "${src%.jsonl}" "$tmp/runs/eval/$name" "${LABELS:-}" <<'PY'
import json, os, sys
src, dst, labels = sys.argv[1], sys.argv[2], set(filter(None, sys.argv[3].split(",")))
def kept(record):  # map-free arms always; an arm through a map when its label is asked for (or no LABELS)
    arm = record.get("arm", "")
    return not labels or "@" not in arm or arm.rsplit("@", 1)[1] in labels
meta = json.load(open(src + ".meta.json"))
if labels:
    if labels - set(meta["maps"]):
        sys.exit(f"LABELS {','.join(sorted(labels - set(meta['maps'])))}: not a map of {src}.jsonl")
    meta["maps"] = {k: v for k, v in meta["maps"].items() if k in labels}
open(dst + ".meta.json", "w").write(json.dumps(meta, indent=1) + "\n")
for part in (".jsonl", ".timings.jsonl"):
    if not os.path.isfile(src + part):
        continue
    keep = []
    for line in open(src + part):
        try:  # a line the running evaluation is still writing is left out; it resumes from the rest
            record = json.loads(line)
        except ValueError:
            continue
        if not kept(record):
            continue
        keep.append(line if line.endswith("\n") else line + "\n")
    open(dst + part, "w").writelines(keep)
    print(f"{os.path.basename(dst)}{part}: {len(keep)} records", file=sys.stderr)
PY
gzip -n -c "$tmp/runs/eval/$name.jsonl" > "$art/$name.jsonl.gz"
t=$tmp/runs/eval/$name.timings.jsonl
[ ! -f "$t" ] || gzip -n -c "$t" > "$art/$name.timings.jsonl.gz"
cp "$tmp/runs/eval/$name.meta.json" "$art/$name.meta.json"
(cd "$tmp" && rarecache eval report "runs/eval/$name.jsonl" --plots "$art" > "$art/$name.report.md" \
    && rarecache eval report "runs/eval/$name.jsonl" --compact > "$art/$name.compact.md")
head -1 "$art/$name.report.md"
