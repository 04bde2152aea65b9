#!/usr/bin/env bash
# Issue #41, candidate v8 (research/scripts/fidelity_v8.sh), the rest of what research/fidelity/ADOPTION.md asks
# before a map can replace the served one: rule 4a's other arms (rank at 0.2 and 0.3 on the four tasks, rank
# at 0.2 on passage QA, suffix 0.2 and rank 0.2 on CoQA), after GSM8K exact match (100 items, 8-shot CoT) for
# v8 at suffix 0.3 (GSM_ARMS: more) beside the adoption file's v3 and v4 arms, the served arm's last missing
# task. Added to fidelity_v8.sh's files. Resumable:
#   nohup bash research/scripts/frozen.sh research/scripts/fidelity_v8_rule4.sh >> ~/.cache/rarecache/runs/fidelity_v8.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/v8
V8=${V8:-$R/maps/general-tok-64k-klmc.safetensors}
for f in "$V8" "$E/hellaswag.jsonl" "$E/drift-coqa-v8-50.jsonl"; do  # (fidelity_v8.sh seeds them on a fresh machine)
  [ -f "$f" ] || { echo "run research/scripts/fidelity_v8.sh first ($f)" >&2; exit 1; }; done
run() { rarecache eval run --task "$1" --source $S --target $T --map v8="$V8" --arms target source "${@:3}" \
    --limit "$2" --dtype bfloat16 --out "$E/$1.jsonl" > /dev/null; }
. research/scripts/lib.sh
seed_from "$E" gsm8k research/fidelity/v8 research/fidelity/adopt  # a session's rows, else the adoption's
rarecache eval run --task gsm8k --source $S --target $T --map v8="$V8" --arms target source 0.3:suffix@v8 \
    ${GSM_ARMS:-} --limit 100 --batch 10 --dtype bfloat16 --out "$E/gsm8k.jsonl" > /dev/null
for task in mmlu arc_challenge hellaswag; do run $task 300 0.3:rank@v8 0.2:rank@v8; done
run coqa_passage 300 0.2:rank@v8
rarecache eval drift run --source $S --target $T --map "$V8" --arms alone 0.3:suffix 0.3:rank 0.2:suffix 0.2:rank \
    --stories 50 --dtype bfloat16 --out $E/drift-coqa-v8-50.jsonl > /dev/null
echo V8 RULE4 DONE
