#!/usr/bin/env bash
# Issue #41 item 4, rule 4 (research/fidelity/ADOPTION.md, 4a-4b): the default arm chosen again, among suffix and
# rank at ρ 0.2 and 0.3 through v4-tok (bf16-stored, the file adopt_v4.sh made), on the same 300 items and 50
# CoQA stories as the served arm. The arms are added to adopt_v4.sh's files (their target, source, v3 and
# suffix-0.2 rows stay), in the order that settles the ranking soonest: the 0.3 arms on the four tasks, then
# on CoQA, then rank at 0.2. Resumable; run after adopt_v4.sh:
#   nohup bash research/scripts/frozen.sh research/scripts/adopt_v4_rule4.sh >> ~/.cache/rarecache/runs/adopt_v4.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/adopt
. research/scripts/lib.sh; V3=$(v3_map); V4B=$R/maps/general-tok-64k-bf16w.safetensors
for f in "$V4B" "$E/mmlu.jsonl" "$E/drift-coqa-v4b-50.jsonl"; do
  [ -f "$f" ] || { echo "run research/scripts/adopt_v4.sh first ($f)" >&2; exit 1; }; done
run() { rarecache eval run --task "$1" --source $S --target $T --map v3=$V3 v4b="$V4B" --arms target source "${@:2}" \
    --limit 300 --dtype bfloat16 --out "$E/$1.jsonl" > /dev/null; }
drift() { rarecache eval drift run --source $S --target $T --map "$V4B" --arms alone 0.2:suffix "$@" --stories 50 \
    --dtype bfloat16 --out $E/drift-coqa-v4b-50.jsonl > /dev/null; }
rarecache eval probe --source $S --target $T --map v3=$V3 v4b="$V4B" --arms 0:rank 0.2:suffix 0.3:suffix 0.2:rank \
    0.3:rank --dtype bfloat16 --out $E/probe.jsonl > /dev/null  # the summary file's probe, through the served files
for task in mmlu arc_challenge hellaswag coqa_passage; do run $task 0.3:suffix@v4b 0.3:rank@v4b; done
drift 0.3:suffix 0.3:rank
for task in mmlu arc_challenge hellaswag coqa_passage; do run $task 0.2:rank@v4b; done
drift 0.2:rank
echo RULE4 DONE
