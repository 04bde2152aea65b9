#!/usr/bin/env bash
# Issue #44: the gate's ladders (every rung a direct handoff, each rung's signals recorded) on held-apart items
# 300-499 of every task, through the served map (rarecache/data, v3) with the served selector (suffix), bf16 as
# serve runs; then GSM8K exact match on evaluated items 0-99 (target, 0.5B alone, the served handoff). Resumable:
# each `eval run` continues its results file. Run from a frozen copy:
#   nohup bash research/scripts/frozen.sh research/scripts/gate_held.sh >> ~/.cache/rarecache/runs/gate-held.log 2>&1 &
# then `rarecache eval gate fit RUNS/eval/held-*.jsonl --out policy.json` prints each signal's AUC.
# START=500 TASKS="mmlu hellaswag": the fresh items research/gate/PREDICTION.md names (RUNS/eval/held500-TASK.jsonl).
# START=0 N=100 TASKS="mmlu arc_challenge hellaswag": the evaluated items the gate's summary reports on
# (RUNS/eval/gate-eval-TASK.jsonl; `eval gate report` with the policy fitted on items 300-499).
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/eval; mkdir -p $E
. research/scripts/lib.sh; V3=$(v3_map)  # served until v4
for task in ${TASKS:-mmlu arc_challenge hellaswag gsm8k_bpb}; do  # (TASKS=none: straight to exact match)
  [ "$task" = none ] && continue
  out=$E/held-$task.jsonl; [ "${START:-300}" = 300 ] || out=$E/held${START}-$task.jsonl
  [ "${START:-300}" != 0 ] || out=$E/gate-eval-$task.jsonl
  rarecache eval run --task $task --source $S --target $T --map v3=$V3 --arms target ladder:suffix@v3 \
      --start ${START:-300} --limit ${N:-200} --dtype bfloat16 --out $out > /dev/null
done
rarecache eval run --task gsm8k --source $S --target $T --map v3=$V3 --arms target source 0.2:suffix@v3 \
    --limit ${N_EM:-100} --batch 10 --dtype bfloat16 --out $E/em-gsm8k.jsonl > /dev/null
echo GATE-HELD DONE
