#!/usr/bin/env bash
# Issue #41's second candidate, v5: v4-tok (research/scripts/fidelity_v4.sh) refined on the target's own
# next-token distribution (`rarecache refine`: KL at the suffix a handoff recomputes, over mapped rows, on the
# general mix after the map's fit documents). Screened against v4 and v3 by the rule written before the runs
# (research/fidelity/ADOPTION.md), in the SAME files: the committed step-1 records (research/fidelity/runs/
# fid-TASK-100, probe-v4) are unpacked as the start of each file and only v5's arms are added, so target,
# source, v3 and v4 are the rows already published (the map files are checked by sha256 per label).
# Resumable (every step appends and skips what is done); the maps are never committed (issue #41 item 6):
#   N=100 nohup bash research/scripts/frozen.sh research/scripts/fidelity_v5.sh >> ~/.cache/rarecache/runs/fidelity_v5.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval5
mkdir -p "$M" "$E"
V4=$M/general-tok-64k-bf16.safetensors
V5=${V5:-$M/general-tok-64k-bf16-kl.safetensors}
[ -f "$V4" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$V4"
[ -f "$V5" ] || rarecache refine "$V4" --source $S --target $T --preset general --dtype bfloat16 \
    --steps "${STEPS:-240}" --lr "${LR:-0.001}" --out "$V5"
seed() {  # the published step-1 record of $1 as the start of $E/$2 (once)
  [ -f "$E/$2.jsonl" ] && return 0
  zcat "research/fidelity/runs/$1.jsonl.gz" > "$E/$2.jsonl"
  [ -f "research/fidelity/runs/$1.timings.jsonl.gz" ] && zcat "research/fidelity/runs/$1.timings.jsonl.gz" > "$E/$2.timings.jsonl"
  cp "research/fidelity/runs/$1.meta.json" "$E/$2.meta.json"
}
seed probe-v4 probe
rarecache eval probe --source $S --target $T --map v5="$V5" --arms 0:rank 0.2:suffix 0.3:rank \
    --out "$E/probe.jsonl" > /dev/null
# v5's arms beside the published ones: plain transfer, the default (suffix at 0.2) and, where the answer is read
# from a mapped passage, rank at 0.3 (v4's best there, research/fidelity/runs/fid-coqa_passage-budgets-100)
arms() { case $1 in coqa_passage) echo "0:rank@v5 0.2:suffix@v5 0.3:rank@v5";; *) echo "0:rank@v5 0.2:suffix@v5";; esac; }
for task in mmlu coqa_passage arc_challenge hellaswag; do
  seed "fid-$task-100" "fid-$task"
  # shellcheck disable=SC2046
  rarecache eval run --task $task --source $S --target $T --map v5="$V5" --arms target source $(arms $task) \
      --limit "${N:-100}" --out "$E/fid-$task.jsonl" > /dev/null
done
