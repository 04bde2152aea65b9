#!/usr/bin/env bash
# Issue #41's attention-weighted candidate, v7: v4-tok's recipe (research/LOG.md §10: the general mix, 64k
# positions, token inputs, layer 0 exact, bf16 statistics) with each fit position weighed by the attention it
# receives in the 1.5B (`calibrate --attention-weights 1`, CacheBridge's idea), then the screen's first step:
# items 0..N-1 of MMLU (then, TASKS="coqa_passage arc_challenge hellaswag", the others), the served arm (suffix
# 0.2) through v7 added to a copy of the committed screen file (research/fidelity/runs/fid-TASK-100: the 1.5B,
# the 0.5B, v3 and v4-tok on the same items, bf16).
# Resumable; the map is not committed (this command rebuilds it):
#   nohup bash research/scripts/frozen.sh research/scripts/fidelity_v7.sh >> ~/.cache/rarecache/runs/fidelity_v7.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval7; mkdir -p $M $E
V7=$M/general-tok-attn-64k-bf16.safetensors
[ -f "$V7" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --attention-weights ${POWER:-1} --dtype bfloat16 --out "$V7"
for task in ${TASKS:-mmlu}; do
  F=research/fidelity/runs/fid-$task-100
  [ -f $E/fid-$task.jsonl ] || { gzip -dc $F.jsonl.gz > $E/fid-$task.jsonl; cp $F.meta.json $E/fid-$task.meta.json;
                                 gzip -dc $F.timings.jsonl.gz > $E/fid-$task.timings.jsonl; }
  rarecache eval run --task $task --source $S --target $T --map v7="$V7" --arms target source 0.2:suffix@v7 \
      --limit "${N:-100}" --dtype bfloat16 --out $E/fid-$task.jsonl > /dev/null
done
echo FIDELITY-V7 DONE
