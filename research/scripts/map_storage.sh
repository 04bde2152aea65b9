#!/usr/bin/env bash
# Issue #42: how compactly may the served map be stored? v3's weights written again in bfloat16
# (`refit --weights-dtype bfloat16`: half the bytes) against the float32 file, both through the served
# configuration (suffix at 0.2) and plain transfer, in float32 (where the rounding reaches the rows; a bf16
# handoff maps the same rows from either file, tests/test_transfer.py), on evaluated items 0-99.
#   nohup bash research/scripts/frozen.sh research/scripts/map_storage.sh >> ~/.cache/rarecache/runs/map-storage.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/eval; mkdir -p $E $R/maps
. research/scripts/lib.sh; V3=$(v3_map); HALF=$R/maps/general-v3-64k-bf16w.safetensors
[ -f $HALF ] || rarecache refit --map $V3 --weights-dtype bfloat16 --out $HALF
for task in ${TASKS:-mmlu arc_challenge}; do  # (hellaswag: TASKS=..., about 40 minutes in float32)
  rarecache eval run --task $task --source $S --target $T --map f32=$V3 bf16w=$HALF \
      --arms target 0:suffix@f32 0:suffix@bf16w 0.2:suffix@f32 0.2:suffix@bf16w \
      --limit ${N:-100} --dtype float32 --out $E/storage-$task.jsonl > /dev/null
done
echo MAP-STORAGE DONE
