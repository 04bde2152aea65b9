#!/usr/bin/env bash
# Issue #41: what MMLU agreement is reachable at all? (1) the 1.5B's own answers under rounding alone: float32
# against the evaluations' bf16; (2) the served map's suffix handoff at larger budgets (rho 0.5 and 0.7), so the
# acceptance's 85% at rho 0.2 can be read against what recomputing most of the prompt gives. Then the table
# (research/scripts/agreement_ceiling.py) against the adoption's bf16 1.5B on the same 300 items. Resumable:
#   nohup bash research/scripts/frozen.sh research/scripts/mmlu_ceiling.sh >> ~/.cache/rarecache/runs/mmlu_ceiling.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/ceiling; mkdir -p $E
V4=rarecache/data/general-v4-64k.safetensors
. research/scripts/lib.sh
seed_from $E mmlu-fp32 research/fidelity/ceiling; seed_from $E mmlu-curve research/fidelity/ceiling  # a session's rows
rarecache eval run --task mmlu --source $S --target $T --map v4=$V4 --arms target --limit 300 --dtype float32 \
    --out $E/mmlu-fp32.jsonl > /dev/null
rarecache eval run --task mmlu --source $S --target $T --map v4=$V4 --arms target 0.5:suffix@v4 0.7:suffix@v4 \
    --limit 300 --dtype bfloat16 --out $E/mmlu-curve.jsonl > /dev/null
A=research/fidelity/adopt/mmlu.jsonl.gz
python research/scripts/agreement_ceiling.py $A $E/mmlu-fp32.jsonl:target:1.5B-float32 \
    $E/mmlu-curve.jsonl:target:1.5B-bf16-again $A:source:0.5B $A:rho=0.2/suffix@v4b:suffix-0.2 \
    $A:rho=0.3/suffix@v4b:suffix-0.3 $E/mmlu-curve.jsonl:rho=0.5/suffix@v4:suffix-0.5 \
    $E/mmlu-curve.jsonl:rho=0.7/suffix@v4:suffix-0.7 $A:rho=0.3/rank@v4b:rank-0.3 | tee "$E/mmlu.md"  # (committed as research/fidelity/ceiling/mmlu.md)
