#!/usr/bin/env bash
# ADOPTION.md rule 11 (written before these runs): attn-source-line / attn-source-block beside the served
# attn-source-span, through the served map v4 (sha 7145adb2). Runs under RUNS/rule11/, each file started from the
# committed records of the same items (seed_from), so only the new arms run; resumable like every eval run.
#   step 1 (rule 11 (i)): code_qa and multidoc_qa at T 2048, items 0-49, both variants
#   step 2 (rule 11 (ii), CANDIDATE=attn-source-block|attn-source-line): the rest of rule 9's items
#   step 12 (rule 12 (i)): attn-source-mix on step 1's items; its (ii) is step 2 with CANDIDATE=attn-source-mix
#   step 13 (rule 13): attn-source-block against the span on unseen items (T 1024, T 4096 items 30-59), then its
#     guards (T 2048's other three tasks, the short tasks). Read (T 4096's files hold items 0-29 from longctx/):
#   python research/scripts/longctx_rules.py 9 RUNS/rule11/*-1024.jsonl RUNS/rule11/r13-*-4096.jsonl \
#       --served rho=0.3/attn-source-span@v4b --arms rho=0.3/attn-source-span@v4b rho=0.3/attn-source-block@v4b
# Read:
#   python research/scripts/longctx_rules.py 9 RUNS/rule11/{code_qa,multidoc_qa}-2048.jsonl \
#       --arms rho=0.3/attn-source-line@v4b rho=0.3/attn-source-block@v4b
#   python research/scripts/longctx_rules.py 9 RUNS/rule11/*-2048.jsonl RUNS/rule11/*-4096.jsonl \
#       --served rho=0.3/attn-source-span@v4b --arms rho=0.3/attn-source-span@v4b rho=0.3/$CANDIDATE@v4b \
#       --short RUNS/rule11/{mmlu,arc_challenge,hellaswag}.jsonl
#   nohup bash research/scripts/rule11.sh 1 > ~/.cache/rarecache/runs/rule11.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/rule11; mkdir -p $E
V4=rarecache/data/general-v4-64k.safetensors
. research/scripts/lib.sh
L=research/fidelity/longctx; F=research/fidelity/f32head; D=research/fidelity/rule11
run() {  # TASK LENGTH ITEMS ARMS...: one run, continued (from this rule's committed rows first)
  local task=$1 len=$2 n=$3 name=$1${2:+-$2}; shift 3
  seed_from $E $name $D $L $F
  rarecache eval run --task $task ${len:+--length $len} --source $S --target $T --map v4b=$V4 --arms "$@" \
      --limit $n --threads 1 --out $E/$name.jsonl > /dev/null
}
case ${1:?step 1, 12, 13 or 2} in
  1) for task in code_qa multidoc_qa; do
       run $task 2048 50 target source 0.3:attn-source-span@v4b 0.3:attn-source-line@v4b 0.3:attn-source-block@v4b
     done;;
  12) for task in code_qa multidoc_qa; do run $task 2048 50 target source 0.3:attn-source-span@v4b 0.3:attn-source-mix@v4b; done;;
  13) P="target source 0.3:attn-source-span@v4b 0.3:attn-source-block@v4b"
     for task in code_qa multidoc_qa multiturn passage_qa_gen retrieval; do run $task 1024 100 $P; done
     for task in retrieval multidoc_qa; do  # items 30-59 only, in their own files (this rule's rows only)
       seed_from $E r13-$task-4096 $D
       rarecache eval run --task $task --length 4096 --source $S --target $T --map v4b=$V4 --arms $P --start 30 \
           --limit 30 --threads 1 --out $E/r13-$task-4096.jsonl > /dev/null
     done
     for task in multiturn passage_qa_gen retrieval; do run $task 2048 100 $P; done
     for task in mmlu arc_challenge hellaswag; do run $task "" 300 $P; done;;
  2) C=0.3:${CANDIDATE:?attn-source-block or attn-source-line}@v4b
     for task in multiturn passage_qa_gen retrieval; do run $task 2048 50 target source 0.3:attn-source-span@v4b $C; done
     for task in retrieval multidoc_qa; do run $task 4096 30 target source 0.3:attn-source-span@v4b $C; done
     for task in mmlu arc_challenge hellaswag; do run $task "" 300 target source 0.3:attn-source-span@v4b $C; done;;
esac
