#!/usr/bin/env bash
# How good can plain transfer (rho 0) get on GSM8K bits per byte with a linear map of this pair? #15's second
# criterion asks plain transfer through the general map to be no worse than the 0.5B alone; on GSM8K it is
# 0.026 bpb worse at n = 300 (research/LOG.md 8). Two maps of the general map's form (ridge for handoffs, keys R2^-1 /
# values R2^-0.5 for plain transfer), each scored on the evaluated items beside the source alone:
#   task:   GSM8K's own held-apart prompts (research/LOG.md 5.5's task map: test items 1000-1318 behind the same eight
#           exemplars as every evaluated prompt, 763 of its ~830 tokens), so it has seen the rows it maps;
#   reshot: the same pool in GSM8K's format with the exemplars drawn from the pool too and the instruction
#           reworded (research/scripts/ceiling_corpus.py): GSM8K's distribution and layout, none of its evaluated text,
#           the most a general map that must be disjoint from every evaluated item could know of this task.
# Resumable: calibrations continue from their .state, evaluations from their results files. N: items (100).
#   nohup bash research/scripts/frozen.sh research/scripts/ceiling.sh >> ~/.cache/rarecache/runs/ceiling/ceiling.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}/ceiling
mkdir -p "$R"
FIT=(--tokens 65536 --heldout-tokens 8192 --seq-len 1024 --dtype float32 --sharpen 0 0 --plain-sharpen 1 0.5)
TASK=$R/gsm8k-64k.safetensors
RESHOT=$R/gsm8k-reshot-64k.safetensors
[ -f "$TASK" ] || rarecache calibrate --source $S --target $T --task gsm8k "${FIT[@]}" --out "$TASK"
[ -f "$R/gsm8k-reshot.jsonl" ] || python research/scripts/ceiling_corpus.py "$R/gsm8k-reshot.jsonl"
[ -f "$RESHOT" ] || rarecache calibrate --source $S --target $T --corpus "$R/gsm8k-reshot.jsonl:text" --chat \
    "${FIT[@]}" --out "$RESHOT"
for m in "$TASK" "$RESHOT"; do  # the same tensors with plain transfer through the ridge fit
  [ -f "${m%.safetensors}-ridge.safetensors" ] || rarecache refit --map "$m" --plain-sharpen 0 0 \
      --out "${m%.safetensors}-ridge.safetensors"
done
ev() {  # label-prefix map out
  rarecache eval run --task gsm8k_bpb --source $S --target $T --map "$1sharp=$2" "$1ridge=${2%.safetensors}-ridge.safetensors" \
      --arms source 0:rank@$1sharp 0:rank@$1ridge --limit "${N:-100}" --dtype float32 --out "$3"
}
ev t "$TASK" "$R/ceiling-gsm8k_bpb.jsonl"
ev r "$RESHOT" "$R/ceiling-reshot-gsm8k_bpb.jsonl"
