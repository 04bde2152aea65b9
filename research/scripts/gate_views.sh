#!/usr/bin/env bash
# The gate's two-view signals, js_views and answer_views (research/LOG.md 9), on held-apart items 300-349 of every task: ladders through
# the served file (it holds both views: handoffs through its ridge fit, plain transfer through its sharpened one).
# Resumable like general.sh; run beside it from a frozen copy:
#   nohup bash research/scripts/frozen.sh research/scripts/gate_views.sh >> ~/.cache/rarecache/runs/views.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/eval
. research/scripts/lib.sh  # seed
SERVED=$R/maps/general-64k.safetensors
shipped $SERVED
for task in hellaswag mmlu arc_challenge gsm8k_bpb; do  # (HellaSwag first: where the views disagreed most)
  seed $E/views-held-$task.jsonl
  rarecache eval run --task $task --source $S --target $T --map views=$SERVED --arms target ladder:suffix@views \
      --start 300 --limit ${N:-50} --dtype float32 --out $E/views-held-$task.jsonl > /dev/null
done
echo VIEWS DONE
