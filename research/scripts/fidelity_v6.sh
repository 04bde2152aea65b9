#!/usr/bin/env bash
# Issue #41's third candidate, v6: v4-tok refined as v5 (research/scripts/fidelity_v5.sh) but with the loss
# weighted by context (`rarecache refine --weighting context`: each recomputed position counts by how much the
# 1.5B's prediction there reads text more than 16 tokens back), aimed at v5's loss on MMLU. Its arms are added
# to v5's files (target, source, v3, v4, v5 rows already there), in the order the question needs them: MMLU,
# passage QA, the probe, then ARC-C and HellaSwag. Resumable; the map is not committed:
#   N=100 nohup bash research/scripts/frozen.sh research/scripts/fidelity_v6.sh >> ~/.cache/rarecache/runs/fidelity_v6.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval5
V4=$M/general-tok-64k-bf16.safetensors
V6=${V6:-$M/general-tok-64k-bf16-klctx.safetensors}
[ -f "$V4" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$V4"
[ -f "$V6" ] || rarecache refine "$V4" --source $S --target $T --preset general --dtype bfloat16 \
    --steps "${STEPS:-240}" --every 40 --lr "${LR:-0.00001}" --weighting context --out "$V6"
[ -f "$E/fid-mmlu.jsonl" ] || { echo "run research/scripts/fidelity_v5.sh first (its files are v6's start)" >&2; exit 1; }
run() { rarecache eval run --task "$1" --source $S --target $T --map v6="$V6" --arms target source "${@:2}" \
    --limit "${N:-100}" --out "$E/fid-$1.jsonl" > /dev/null; }
run mmlu 0.2:suffix@v6
run coqa_passage 0.2:suffix@v6 0.3:rank@v6
rarecache eval probe --source $S --target $T --map v6="$V6" --arms 0:rank 0.2:suffix 0.3:rank \
    --out "$E/probe.jsonl" > /dev/null
run arc_challenge 0.2:suffix@v6
run hellaswag 0.2:suffix@v6
