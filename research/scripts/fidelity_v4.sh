#!/usr/bin/env bash
# Issue #41's first candidate map, v4-tok: the general mix with the token itself as input (--token-inputs: every
# target layer's ridge also reads the target's own layer-0 K/V rows of the token, exact from the token) and layer
# 0 computed from the token (--exact-layer0). Screened against the served map (v3) in the SAME files, by the
# adoption rule written before the run (research/fidelity/ADOPTION.md):
#   1. the probe (eval probe: KL from the target's own next-token distribution, minutes);
#   2. tasks at N items (0..N-1), both maps: target / source / plain (0:rank) / 0.2:suffix, and through v4 the
#      two other selectors at 0.2 the default is chosen among again (rank, suffix+rank),
#      in the order the acceptance reads them: MMLU, passage QA (coqa_passage), ARC-C, HellaSwag.
# Resumable: every step appends to its JSONL and skips what is done; a fresh machine rebuilds the map by the
# recorded command (deterministic on one machine only: research/scripts/rebase_map.py), the map is never
# committed (issue #41 item 6). Run from a frozen copy so edits under a running queue change nothing:
#   N=100 nohup bash research/scripts/frozen.sh research/scripts/fidelity_v4.sh >> ~/.cache/rarecache/runs/fidelity_v4.log 2>&1 &
#   STEP2=1 N=100 nohup bash ... (step 1 is then already done and skips)
# Publish as the other queues do (research/scripts/publish.sh) into research/fidelity/.
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval
mkdir -p "$M" "$E"
. research/scripts/lib.sh; V3=${V3:-$(v3_map)}  # v3, served until v4
V4=$M/general-tok-64k-bf16.safetensors
[ -f "$V4" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$V4"
MAPS=(v3="$V3" v4="$V4")
rarecache eval probe --source $S --target $T --map "${MAPS[@]}" --arms 0:rank 0.2:suffix 0.2:rank 0.3:rank \
    --out "$E/probe-v4.jsonl" > /dev/null
for task in mmlu coqa_passage arc_challenge hellaswag; do
  rarecache eval run --task $task --source $S --target $T --map "${MAPS[@]}" \
      --arms target source 0:rank@v3 0:rank@v4 0.2:suffix@v3 0.2:suffix@v4 0.2:rank@v4 0.2:suffix+rank@v4 \
      --limit "${N:-100}" --out "$E/fid-$task.jsonl" > /dev/null
done
# Step 2 (STEP2=1, after step 1 is read): MMLU to the acceptance's 300 items with the default arm through both
# maps, then the passage task's budgets through v4 (rank and suffix at 0.3 and 0.5), for the choice of the
# default arm by agreement (research/fidelity/ADOPTION.md 4).
[ "${STEP2:-0}" = 1 ] || exit 0
rarecache eval run --task mmlu --source $S --target $T --map "${MAPS[@]}" \
    --arms target source 0:rank@v3 0:rank@v4 0.2:suffix@v3 0.2:suffix@v4 --limit 300 --out "$E/fid-mmlu.jsonl" > /dev/null
rarecache eval run --task coqa_passage --source $S --target $T --map "${MAPS[@]}" \
    --arms target source 0.3:rank@v4 0.5:rank@v4 0.3:suffix@v4 0.5:suffix@v4 --limit "${N:-100}" \
    --out "$E/fid-coqa_passage.jsonl" > /dev/null
