#!/usr/bin/env bash
# Issue #54, thirteenth session: does a map that has seen long multi-document text carry multidoc QA's agreement
# when the picks come from the 1.5B's own attention (`query-w8`) rather than the 0.5B's (the span)?
#   step v10:  ADOPTION.md rule 17 (i): calibrate v10 (the general-v4 mix: v3's and the five long-context tasks'
#              held-apart items, 131,072 tokens of 2,048-token sequences, v4's other settings; stored in bf16), then
#              `attn-source-span` and `query-w8` at rho 0.3 through it on multidoc_qa T 2048 items 0-99; the target's
#              and v4's rows are research/fidelity/mdceil's (read with them merged).
#   step v11:  ADOPTION.md rule 18 (i): the same with v11 (the general-v5 mix: the long share at 8 documents a round
#              of 22, 262,144 tokens)
#   step diag-unseen: the same diagnostic where no arm was chosen: the task map's `query-w8` and span on
#              multidoc_qa T 4096 items 30-59 and T 1024 items 0-99, each file started from research/fidelity/rule11's
#              rows of the same items (target, source, v4's arms)
#   step diag: a diagnostic (no rule; the map is fitted on the task's held-apart items, so it cannot be adopted):
#              `query-w8` through the task map (sha 57edb4d7, research/fidelity/mdceil) on multidoc_qa T 2048
#              items 0-99, beside the span through it (mdceil's taskmap rows) and both through v4.
# Read: rarecache eval report RUNS/longmap/multidoc_qa-2048-taskmap.jsonl
#   nohup bash research/scripts/longmap.sh diag > ~/.cache/rarecache/runs/longmap-diag.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/longmap; mkdir -p $E
MD=$R/mdceil/multidoc-task-64k.safetensors
. research/scripts/lib.sh
general_map() {  # general_map LABEL PRESET TOKENS: calibrate RUNS/longmap/general-LABEL (stored in bf16) on the
  # preset's mix with v4's other settings, then rule 17/18 (i)'s screen through it
  local f=$E/general-$1-$(($3 / 1024))k
  [ -f $f.safetensors ] || rarecache calibrate --source $S --target $T --preset $2 --tokens $3 \
      --heldout-tokens 8192 --token-inputs --exact-layer0 --dtype bfloat16 --out $f.safetensors
  [ -f $f-bf16.safetensors ] || rarecache refit --map $f.safetensors --weights-dtype bfloat16 --out $f-bf16.safetensors
  rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map $1=$f-bf16.safetensors \
      --arms 0.3:attn-source-span@$1 0.3:query-w8@$1 --limit 100 --threads 2 --out $E/multidoc_qa-2048-$1.jsonl > /dev/null
}
case ${1:?step v10, v11, diag-unseen or diag} in
  v10) general_map v10 general-v4 131072;;
  v11) general_map v11 general-v5 262144;;
  diag) # the task map is made by research/scripts/multidoc_ceiling.sh taskmap (its calibrate line)
     [ -f $MD ] || { echo "make $MD first: bash research/scripts/multidoc_ceiling.sh taskmap" >&2; exit 2; }
     seed_from $E multidoc_qa-2048-taskmap research/fidelity/mdceil
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map md=$MD \
         --arms 0.3:attn-source-span@md 0.3:query-w8@md --limit 100 --threads 2 \
         --out $E/multidoc_qa-2048-taskmap.jsonl > /dev/null;;
  diag-unseen) [ -f $MD ] || { echo "make $MD first: bash research/scripts/multidoc_ceiling.sh taskmap" >&2; exit 2; }
     seed_as $E multidoc_qa-4096-taskmap research/fidelity/rule11 r13-multidoc_qa-4096
     seed_as $E multidoc_qa-1024-taskmap research/fidelity/rule11 multidoc_qa-1024
     rarecache eval run --task multidoc_qa --length 4096 --source $S --target $T --map md=$MD \
         --arms target source 0.3:query-w8@md 0.3:attn-source-span@md --start 30 --limit 30 --threads 2 \
         --out $E/multidoc_qa-4096-taskmap.jsonl > /dev/null
     rarecache eval run --task multidoc_qa --length 1024 --source $S --target $T --map md=$MD \
         --arms target source 0.3:query-w8@md 0.3:attn-source-span@md --limit 100 --threads 2 \
         --out $E/multidoc_qa-1024-taskmap.jsonl > /dev/null;;
  *) echo "unknown step $1: v10, v11, diag-unseen or diag" >&2; exit 2;;
esac
