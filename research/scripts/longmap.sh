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
V10=$E/general-v10-128k.safetensors; V10B=$E/general-v10-128k-bf16.safetensors
V11=$E/general-v11-256k.safetensors; V11B=$E/general-v11-256k-bf16.safetensors
case ${1:?step v10, v11, diag-unseen or diag} in
  v11) [ -f $V11 ] || rarecache calibrate --source $S --target $T --preset general-v5 --tokens 262144 \
         --heldout-tokens 8192 --token-inputs --exact-layer0 --dtype bfloat16 --out $V11
     [ -f $V11B ] || rarecache refit --map $V11 --weights-dtype bfloat16 --out $V11B
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v11=$V11B \
         --arms 0.3:attn-source-span@v11 0.3:query-w8@v11 --limit 100 --threads 2 \
         --out $E/multidoc_qa-2048-v11.jsonl > /dev/null;;
  v10) [ -f $V10 ] || rarecache calibrate --source $S --target $T --preset general-v4 --tokens 131072 \
         --heldout-tokens 8192 --token-inputs --exact-layer0 --dtype bfloat16 --out $V10
     [ -f $V10B ] || rarecache refit --map $V10 --weights-dtype bfloat16 --out $V10B
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v10=$V10B \
         --arms 0.3:attn-source-span@v10 0.3:query-w8@v10 --limit 100 --threads 2 \
         --out $E/multidoc_qa-2048-v10.jsonl > /dev/null;;
  diag) # the task map is made by research/scripts/multidoc_ceiling.sh taskmap (its calibrate line)
     [ -f $MD ] || { echo "make $MD first: bash research/scripts/multidoc_ceiling.sh taskmap" >&2; exit 2; }
     if [ ! -f $E/multidoc_qa-2048-taskmap.jsonl ]; then
       gzip -dc research/fidelity/mdceil/multidoc_qa-2048-taskmap.jsonl.gz > $E/multidoc_qa-2048-taskmap.jsonl
       gzip -dc research/fidelity/mdceil/multidoc_qa-2048-taskmap.timings.jsonl.gz > $E/multidoc_qa-2048-taskmap.timings.jsonl
       sed "s|RUNS/|$R/|g" research/fidelity/mdceil/multidoc_qa-2048-taskmap.meta.json > $E/multidoc_qa-2048-taskmap.meta.json
     fi
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map md=$MD \
         --arms 0.3:attn-source-span@md 0.3:query-w8@md --limit 100 --threads 2 \
         --out $E/multidoc_qa-2048-taskmap.jsonl > /dev/null;;
  diag-unseen) [ -f $MD ] || { echo "make $MD first: bash research/scripts/multidoc_ceiling.sh taskmap" >&2; exit 2; }
     for f in "multidoc_qa-4096 r13-multidoc_qa-4096" "multidoc_qa-1024 multidoc_qa-1024"; do
       set -- $f; [ -f $E/$1-taskmap.jsonl ] && continue
       gzip -dc research/fidelity/rule11/$2.jsonl.gz > $E/$1-taskmap.jsonl
       gzip -dc research/fidelity/rule11/$2.timings.jsonl.gz > $E/$1-taskmap.timings.jsonl
       sed "s|RUNS/|$R/|g" research/fidelity/rule11/$2.meta.json > $E/$1-taskmap.meta.json
     done
     rarecache eval run --task multidoc_qa --length 4096 --source $S --target $T --map md=$MD \
         --arms target source 0.3:query-w8@md 0.3:attn-source-span@md --start 30 --limit 30 --threads 2 \
         --out $E/multidoc_qa-4096-taskmap.jsonl > /dev/null
     rarecache eval run --task multidoc_qa --length 1024 --source $S --target $T --map md=$MD \
         --arms target source 0.3:query-w8@md 0.3:attn-source-span@md --limit 100 --threads 2 \
         --out $E/multidoc_qa-1024-taskmap.jsonl > /dev/null;;
  *) echo "unknown step $1: v10, v11, diag-unseen or diag" >&2; exit 2;;
esac
