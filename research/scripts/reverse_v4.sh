#!/usr/bin/env bash
# Issue #41 item 5 (large -> small through the same designs): the 1.5B -> 0.5B map calibrated as v4-tok
# (research/LOG.md §10: the general mix, 64k positions, the target's own layer-0 rows as inputs, layer 0
# exact), then the 0.5B as target on HellaSwag, ARC-Challenge and MMLU, items 0..N-1: the 0.5B alone, the
# 1.5B alone, plain transfer, suffix at 0.1 and 0.2, rank at 0.2 (ARMS: other arms into the same files, e.g.
# ARMS="target source 0.2:attn-source@rv 0.2:suffix+attn@rv", research/LOG.md §17). Resumable (calibrate keeps its state, each
# `eval run` continues its file); the map is not committed (rebuilt by this command). Run from a frozen copy:
#   N=300 nohup bash research/scripts/frozen.sh research/scripts/reverse_v4.sh >> ~/.cache/rarecache/runs/reverse.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-1.5b-instruct; T=qwen2.5-coder-0.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/reverse; mkdir -p $M $E
RV=$M/general-tok-64k-1.5b-to-0.5b.safetensors
[ -f "$RV" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$RV"
for task in ${TASKS:-hellaswag arc_challenge mmlu}; do
  rarecache eval run --task $task --source $S --target $T --map rv="$RV" \
      --arms ${ARMS:-target source 0:suffix@rv 0.1:suffix@rv 0.2:suffix@rv 0.2:rank@rv} \
      --limit "${N:-300}" --dtype bfloat16 --out "$E/rv-$task.jsonl" > /dev/null
done
echo REVERSE DONE
