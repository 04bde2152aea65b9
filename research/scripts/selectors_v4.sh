#!/usr/bin/env bash
# Issue #41: do the attention selectors keep both halves through v4? Suffix keeps multiple-choice answers
# (the question is the newest text), rank keeps passages (the rows the map is least sure of), and splitting the
# budget between them (suffix+rank) keeps neither (research/LOG.md §15). `attn-source` recomputes the positions
# the 0.5B's last 32 queries attend to most, which is the question and choices on MMLU and, on a passage
# question, the passage's rows the question reads; `suffix+attn` takes the newest and the attended in turn.
# Neither was run on passage QA or CoQA, which came after them. Arms at rho 0.3 through v4 (label v4b, the
# served file), added to copies of the adoption files (research/fidelity/adopt: the 1.5B, the 0.5B and v4's
# suffix and rank arms on the same items); then CoQA switching at every turn. EXTRA_ARMS the arms, TASKS the tasks, DRIFT=""
# skips CoQA, GSM=ARMS runs GSM8K exact match for those arms (research/fidelity/ADOPTION.md rule 7). Resumable:
#   nohup bash research/scripts/frozen.sh research/scripts/selectors_v4.sh >> ~/.cache/rarecache/runs/selectors_v4.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/sel; mkdir -p $E
V4=rarecache/data/general-v4-64k.safetensors
. research/scripts/lib.sh
seed() { seed_from "$E" "$1" research/fidelity/sel research/fidelity/adopt; }  # a session's rows, else the adoption's
EXTRA_ARMS=${EXTRA_ARMS:-0.3:attn-source@v4b 0.3:suffix+attn@v4b}
for task in ${TASKS-coqa_passage mmlu}; do
  seed $task
  rarecache eval run --task $task --source $S --target $T --map v4b="$V4" \
      --arms target source $EXTRA_ARMS --limit 300 --dtype bfloat16 --out "$E/$task.jsonl" > /dev/null
done
if [ -n "${GSM:-}" ]; then  # GSM8K exact match (100 items) for the arms named, e.g. GSM=0.3:attn-source@v4b
  seed gsm8k
  rarecache eval run --task gsm8k --source $S --target $T --map v4b="$V4" --arms target source $GSM --limit 100 \
      --batch 10 --dtype bfloat16 --out "$E/gsm8k.jsonl" > /dev/null
fi
seed drift-coqa-attn-v4-50
[ -n "${DRIFT-1}" ] && rarecache eval drift run --source $S --target $T --map "$V4" \
    --arms alone 0.3:attn-source 0.3:suffix+attn --stories 50 --dtype bfloat16 --out $E/drift-coqa-attn-v4-50.jsonl > /dev/null
echo SELECTORS DONE
