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
# v2's served file (no longer in the tree): shipped copies it from $RARECACHE_V2_MAP, else lib.sh's REBUILT, where
# `git show d7eaf97:docs/artifacts/maps/general-64k.safetensors > FILE` puts back its exact bytes (docs/RESULTS.md,
# "Maps that are no longer in the tree"); the committed views-held runs continue only through those bytes.
SERVED=$R/maps/general-64k.safetensors; mkdir -p $R/maps
[ -z "${RARECACHE_V2_MAP:-}" ] || [ -f $SERVED ] || cp "$RARECACHE_V2_MAP" $SERVED
shipped $SERVED
for task in hellaswag mmlu arc_challenge gsm8k_bpb; do  # (HellaSwag first: where the views disagreed most)
  seed $E/views-held-$task.jsonl
  rarecache eval run --task $task --source $S --target $T --map views=$SERVED --arms target ladder:suffix@views \
      --start 300 --limit ${N:-50} --dtype float32 --out $E/views-held-$task.jsonl > /dev/null
done
echo VIEWS DONE
