#!/usr/bin/env bash
# Issue #41, after v4's adoption (research/LOG.md §15): rule 4 split the tasks between suffix 0.3 (every
# multiple-choice task) and rank 0.3 (passage QA, CoQA). Does `suffix+rank` at 0.3 (half the budget the newest
# positions, half rank disagreement) keep both? Its arm is added to the adoption files (same items, the same
# target, source and v3 rows), in the order the question needs: MMLU, passage QA, CoQA, then ARC-C and
# HellaSwag. Resumable; not an adoption run (adopt_rules.py ranks only rule 4a's arms):
#   nohup bash research/scripts/frozen.sh research/scripts/hybrid_v4.sh >> ~/.cache/rarecache/runs/hybrid_v4.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/adopt
. research/scripts/lib.sh; V3=$(v3_map); V4=rarecache/data/general-v4-64k.safetensors
[ -f "$E/mmlu.jsonl" ] || { echo "run research/scripts/adopt_v4.sh first (its files are this run's start)" >&2; exit 1; }
run() { rarecache eval run --task "$1" --source $S --target $T --map v3=$V3 v4b=$V4 --arms target source \
    0.3:suffix+rank@v4b --limit 300 --dtype bfloat16 --out "$E/$1.jsonl" > /dev/null; }
run mmlu
run coqa_passage
rarecache eval drift run --source $S --target $T --map $V4 --arms alone 0.3:suffix+rank --stories 50 \
    --dtype bfloat16 --out $E/drift-coqa-v4b-50.jsonl > /dev/null
run arc_challenge
run hellaswag
echo HYBRID DONE
