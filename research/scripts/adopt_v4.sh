#!/usr/bin/env bash
# Issue #41 item 4: the 300-item runs research/fidelity/ADOPTION.md asks of the best candidate so far, v4-tok
# (research/LOG.md §10), through the file that would be served (rule 6: its weights in bf16), beside v3 in the
# same files, bf16 as serve runs. Steps, each resumable (`eval run` and `eval drift run` continue their files),
# in the order that settles the rule soonest: the map rebuilt by its recorded command (sha256 8907813a… when it
# was made) and stored in bf16; MMLU (added to a copy of the committed fid-mmlu-300, which holds the 1.5B, the
# 0.5B and v3 on items 0-299); ARC-C, passage QA and HellaSwag items 0-299; GSM8K exact match (added to a copy
# of docs/artifacts/gsm8k-em-v3-100); CoQA, 50 stories switching every turn. Rule 4's other selectors come after.
# Rows a session could not finish are committed under research/fidelity/adopt/ (gzipped, with their records) and
# continued from there on a fresh machine: the map is rebuilt to the same sha256 (checked by `eval run`, which
# refuses to continue a file through another map).
#   nohup bash research/scripts/frozen.sh research/scripts/adopt_v4.sh >> ~/.cache/rarecache/runs/adopt_v4.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/adopt; mkdir -p $M $E
. research/scripts/lib.sh; V3=$(v3_map)  # served until v4
V4=$M/general-tok-64k-bf16.safetensors; V4B=$M/general-tok-64k-bf16w.safetensors
[ -f "$V4" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$V4"
sha256sum "$V4"  # 8907813a23a5fa7803e80313078662fed35143042e7ac8ab6b964181dca1c70f when it was made
[ -f "$V4B" ] || rarecache refit --map "$V4" --weights-dtype bfloat16 --out "$V4B"
P=research/fidelity/adopt  # rows committed by an earlier session (a run continues them), else the base record
copy() {  # a committed record as the start of a results file (its arms are kept; new arms are added)
  [ -f "$2.jsonl" ] && return 0
  local from=$1; [ -f "$P/$(basename "$2").jsonl.gz" ] && from=$P/$(basename "$2")
  gzip -dc "$from.jsonl.gz" > "$2.jsonl"; cp "$from.meta.json" "$2.meta.json"
  [ ! -f "$from.timings.jsonl.gz" ] || gzip -dc "$from.timings.jsonl.gz" > "$2.timings.jsonl"
}
run() { rarecache eval run --task "$1" --source $S --target $T --map v3=$V3 v4b="$V4B" "${@:3}" --dtype bfloat16 \
    --out "$E/$2.jsonl" > /dev/null; }
copy research/fidelity/runs/fid-mmlu-300 $E/mmlu
run mmlu mmlu --arms target source 0.2:suffix@v3 0.2:suffix@v4b --limit 300
for task in arc_challenge coqa_passage hellaswag; do
  [ ! -f "$P/$task.jsonl.gz" ] || copy "$P/$task" "$E/$task"
  run $task $task --arms target source 0.2:suffix@v3 0.2:suffix@v4b --limit 300
done
copy docs/artifacts/gsm8k-em-v3-100 $E/gsm8k
run gsm8k gsm8k --arms target source 0.2:suffix@v3 0.2:suffix@v4b --limit 100 --batch 10
rarecache eval drift run --source $S --target $T --map "$V4B" --arms alone 0.2:suffix --stories 50 --dtype bfloat16 \
    --out $E/drift-coqa-v4b-50.jsonl
echo ADOPT-V4 DONE
