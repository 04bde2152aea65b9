#!/usr/bin/env bash
# How good can plain transfer (rho 0) get on GSM8K bits per byte with a linear map of this pair? #15's second
# criterion asks plain transfer through the general map to be no worse than the 0.5B alone; on GSM8K it is
# 0.026 bpb worse at n = 300 (RESULTS.md 8). This fits the same kind of map on GSM8K's own held-apart prompts
# (RESULTS.md 5.5's task map: test items 1000-1318, the 8-shot exemplars included, which no general mix may
# contain) and scores plain transfer through its ridge fit and through the served file's sharpening (keys R2^-1,
# values R2^-0.5) on the evaluated items 0-299, beside the source alone. If even this map does not beat the
# source, no general map of this form will. Resumable: the calibration continues from its .state and the
# evaluation from its results file. N=100 stops earlier.
#   nohup bash scripts/ceiling.sh >> ~/.cache/rarecache/runs/ceiling/ceiling.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}/ceiling
mkdir -p "$R"
TASK=$R/gsm8k-64k.safetensors       # handoffs: ridge; plain transfer: keys 1, values 0.5 (the served file's form)
RIDGE=$R/gsm8k-64k-ridge.safetensors  # the same tensors, plain transfer through the ridge fit too
[ -f "$TASK" ] || rarecache calibrate --source $S --target $T --task gsm8k --tokens 65536 --heldout-tokens 8192 \
    --seq-len 1024 --dtype float32 --sharpen 0 0 --plain-sharpen 1 0.5 --out "$TASK"
[ -f "$RIDGE" ] || rarecache refit --map "$TASK" --plain-sharpen 0 0 --out "$RIDGE"
rarecache eval run --task gsm8k_bpb --source $S --target $T --map "tsharp=$TASK" "tridge=$RIDGE" \
    --arms source 0:rank@tsharp 0:rank@tridge --limit "${N:-300}" --dtype float32 --out "$R/ceiling-gsm8k_bpb.jsonl"
