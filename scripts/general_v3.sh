#!/usr/bin/env bash
# The candidate general mix v3 (RESULTS.md 8.3: v2 and few-shot chains of GSM8K's held-apart word problems)
# against the served file (v2), before it may replace it. Step 1, here: plain transfer, the arm #15's second
# criterion reads, through both maps' plain views on held-apart items 300-349 of every task (never evaluated),
# beside the source. If v3 is no worse than the source on every task and than v2 elsewhere, the acceptance arms
# run again through it on items 0-299 (general.sh with the map replaced). Resumable like general.sh; N items.
#   nohup bash scripts/frozen.sh scripts/general_v3.sh >> ~/.cache/rarecache/runs/general_v3.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval
mkdir -p $M $E
V3=$M/general-v3-64k.safetensors
SERVED=docs/artifacts/maps/general-64k.safetensors
[ -f $V3 ] || rarecache calibrate --preset general-v3 --source $S --target $T --tokens 65536 --heldout-tokens 8192 \
    --dtype float32 --keep-state --out $V3
for task in gsm8k_bpb arc_challenge mmlu hellaswag; do  # GSM8K first: the task v3 is for
  rarecache eval run --task $task --source $S --target $T --map v3=$V3 v2=$SERVED --arms source 0:rank@v3 0:rank@v2 \
      --start 300 --limit "${N:-50}" --dtype float32 --out $E/v3-held-$task.jsonl > /dev/null
done
