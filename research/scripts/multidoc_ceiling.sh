#!/usr/bin/env bash
# Where does issue #54's multi-document QA bar (agreement >= 85%) sit? A diagnostic, not an adoption rule: no arm
# here can become a default (two are oracles that read the 1.5B's own prefill). Items 0-49 of multidoc_qa at
# T 2048, through the served map v4 (sha 7145adb2), each file started from the committed longctx records so only
# the new arms run; resumable like every eval run.
#   step bf16: the oracles at the served budget (attn-target: the positions the 1.5B's own prefill attends to
#     from its last queries; l2-oracle: the rows the map gets most wrong) and the served selector at rho 0.5, 0.7
#   step f32:  the 1.5B alone in float32, against its own bf16 answers: how much agreement rounding alone moves
#   steps bf16b, f32b: the same on items 50-99 (l2-oracle left out: 20% on items 0-49), so the diagnostic covers
#     the 100 items the served arm's 73% is read on
#   step 4096: the oracle at T 4096 (items 0-29, the served arm's committed rows beside it)
#   step taskmap: a map that has seen multi-document text: fitted on multidoc_qa's held-apart items (its calibration
#     split, checked disjoint from the evaluated ones) with v4's settings, float32 weights; the served selector at
#     rho 0.3 through it on items 0-99 (handoff rows only: target and source are the committed longctx rows)
# Read: rarecache eval report RUNS/mdceil/multidoc_qa-2048.jsonl (and -b, -taskmap); the float32 file's answers
#   against the bf16 target rows of the same items (research/fidelity/mdceil/mdceil.md says how it was read).
# The taskmap step's map is not committed (calibration is deterministic on one machine only): a fresh machine
#   fits it again and its eval starts over rather than continuing the committed rows.
#   nohup bash research/scripts/multidoc_ceiling.sh bf16 > ~/.cache/rarecache/runs/mdceil-bf16.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/mdceil; mkdir -p $E
V4=rarecache/data/general-v4-64k.safetensors
. research/scripts/lib.sh
L=research/fidelity/longctx; D=research/fidelity/mdceil
case ${1:?step bf16, f32, bf16b, f32b, 4096 or taskmap} in
  bf16) seed_from $E multidoc_qa-2048 $D $L
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 --arms target source \
         0.3:attn-source-span@v4b 0.3:attn-target@v4b 0.3:l2-oracle@v4b 0.5:attn-source-span@v4b \
         0.7:attn-source-span@v4b --limit 50 --threads 1 --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  f32) seed_from $E multidoc_qa-2048-f32 $D
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 --arms target \
         --dtype float32 --limit 50 --threads 1 --out $E/multidoc_qa-2048-f32.jsonl > /dev/null;;
  bf16b) [ -f $E/multidoc_qa-2048-b.jsonl ] || [ -f $D/multidoc_qa-2048-b.jsonl.gz ] || {  # from the served rows
       gzip -dc $L/multidoc_qa-2048.jsonl.gz > $E/multidoc_qa-2048-b.jsonl
       gzip -dc $L/multidoc_qa-2048.timings.jsonl.gz > $E/multidoc_qa-2048-b.timings.jsonl
       sed "s|RUNS/|$R/|g" $L/multidoc_qa-2048.meta.json > $E/multidoc_qa-2048-b.meta.json; }
     seed_from $E multidoc_qa-2048-b $D
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 --arms target source \
         0.3:attn-source-span@v4b 0.3:attn-target@v4b 0.5:attn-source-span@v4b 0.7:attn-source-span@v4b \
         --start 50 --limit 50 --threads 1 --out $E/multidoc_qa-2048-b.jsonl > /dev/null;;
  f32b) seed_from $E multidoc_qa-2048-f32 $D
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 --arms target \
         --dtype float32 --start 50 --limit 50 --threads 1 --out $E/multidoc_qa-2048-f32.jsonl > /dev/null;;
  taskmap) MD=$E/multidoc-task-64k.safetensors
     [ -f $MD ] || rarecache calibrate --source $S --target $T --task multidoc_qa --tokens 65536 --heldout-tokens 8192 \
         --seq-len 2048 --token-inputs --exact-layer0 --dtype bfloat16 --out $MD
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map md=$MD \
         --arms 0.3:attn-source-span@md --limit 100 --threads 1 --out $E/multidoc_qa-2048-taskmap.jsonl > /dev/null;;
  4096) seed_from $E multidoc_qa-4096 $D $L
     rarecache eval run --task multidoc_qa --length 4096 --source $S --target $T --map v4b=$V4 --arms target source \
         0.3:attn-source-span@v4b 0.3:attn-target@v4b --limit 30 --threads 2 --out $E/multidoc_qa-4096.jsonl > /dev/null;;
  *) echo "unknown step $1: bf16, f32, bf16b, f32b, 4096 or taskmap" >&2; exit 2;;
esac
