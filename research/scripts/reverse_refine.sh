#!/usr/bin/env bash
# Issue #41 item 5 (large -> small): the 1.5B -> 0.5B token map of research/scripts/reverse_v4.sh refined as v6
# was (`rarecache refine --weighting context`: the 0.5B's next-token KL over a handed-off cache, each recomputed
# position weighted by how much its prediction reads text more than 16 tokens back), at the budgets the
# acceptance allows (rho 0.1 and 0.2). Its arms are added to reverse_v4.sh's files (the 0.5B, the 1.5B and the
# unrefined map's arms already there), so every comparison pairs items. Resumable; the map is not committed:
#   N=300 nohup bash research/scripts/frozen.sh research/scripts/reverse_refine.sh >> ~/.cache/rarecache/runs/reverse_refine.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-1.5b-instruct; T=qwen2.5-coder-0.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/reverse
RV=$M/general-tok-64k-1.5b-to-0.5b.safetensors
RK=${RK:-$M/general-tok-64k-1.5b-to-0.5b-klctx.safetensors}
[ -f "$RV" ] || rarecache calibrate --source $S --target $T --preset general --tokens 65536 --token-inputs \
    --exact-layer0 --dtype bfloat16 --keep-state --out "$RV"
[ -f "$RK" ] || rarecache refine "$RV" --source $S --target $T --preset general --dtype bfloat16 \
    --steps "${STEPS:-240}" --every 40 --lr "${LR:-0.00001}" --weighting context --rhos 0.1 0.2 --out "$RK"
for task in ${TASKS:-hellaswag arc_challenge mmlu}; do
  [ -f "$E/rv-$task.jsonl" ] || { echo "run research/scripts/reverse_v4.sh first (its files are the start)" >&2; exit 1; }
  rarecache eval run --task $task --source $S --target $T --map rv="$RV" --map rk="$RK" \
      --arms target source 0.1:suffix@rk 0.2:suffix@rk 0.2:rank@rk \
      --limit "${N:-300}" --dtype bfloat16 --out "$E/rv-$task.jsonl" > /dev/null
done
echo REVERSE REFINE DONE
