#!/usr/bin/env bash
# The general map (#15): every long CPU run behind docs/RESULTS.md §8, in priority order. Idempotent and
# resumable like results.sh: a map that exists is kept, a calibration resumes from its .state, an evaluation
# resumes from its results file. Run it in the background and rerun it after an interruption:
#   nohup bash scripts/frozen.sh scripts/general.sh >> ~/.cache/rarecache/runs/general.log 2>&1 &
# Maps, states and results go to $RUNS (default ~/.cache/rarecache/runs): outside the work tree, so a fresh
# checkout on the same machine continues them. frozen.sh runs it from a copy of HEAD, so editing the work tree
# (this file included) cannot change what a running queue does.
# Each task runs to 100 items first, then all tasks continue to 300 (the same files: --limit grows), so an
# interrupted queue still has every task at a stated n. float32: on CPUs without AVX-512 BF16 it is the faster
# dtype (this machine: 4.6x faster than bf16). RUNS=DIR puts maps and results elsewhere.
set -euxo pipefail
cd "$(dirname "$0")/.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval
mkdir -p $M $E
DT=(--dtype float32)
gen() {  # source target tokens out
  [ -f "$4" ] || rarecache calibrate --source "$1" --target "$2" --preset general --tokens "$3" \
      --heldout-tokens 8192 "${DT[@]}" --out "$4"
}
GENERAL=$M/general-64k-0.5b-to-1.5b.safetensors
REVERSE=$M/general-64k-1.5b-to-0.5b.safetensors
# the issue's arms (attn+rank is the combined selector; attn-rank, measured on the first gsm8k item only, was
# dropped for CPU time: an 834-token GSM8K item with 18 arms took 6.5 minutes here), and the quality gate's
# ladder (#17), which shares each item's prefills
SEL=attn+rank
ARMS=(target source 0:rank 0.1:rank 0.2:rank 0.3:rank 0.1:attn-source 0.2:attn-source 0.3:attn-source
      0.3:suffix 0.1:$SEL 0.2:$SEL 0.3:$SEL ladder:$SEL)
ev() {  # source target task items out map [start [arms...]]
  local start=${7:-0}; local arms=("${ARMS[@]}"); [ $# -gt 7 ] && arms=("${@:8}")
  rarecache eval run --task "$3" --source "$1" --target "$2" --map "general=$6" --arms "${arms[@]}" \
      --start "$start" --limit "$4" "${DT[@]}" --out "$5" >/dev/null
}
TASKS=(mmlu hellaswag arc_challenge gsm8k_bpb)  # shortest prompts first
gen $S $T 65536 $GENERAL
for task in "${TASKS[@]}"; do
  ev $S $T $task 100 $E/general-$task.jsonl $GENERAL
done
# held apart for fitting the gate's policy: items 300-399, never evaluated
for task in "${TASKS[@]}"; do
  ev $S $T $task 100 $E/held-$task.jsonl $GENERAL 300 target ladder:$SEL
done
# what the numbers so far say: the default selector (general-map summary), the gate's policy fitted on the
# held-apart items with that selector's ladder, its outcome on the evaluated items, CoQA drift through it
A=$R/artifacts; mkdir -p $A
reports() {  # stories
  local gen=() held=() t sel
  for t in "${TASKS[@]}"; do gen+=("$E/general-$t.jsonl"); held+=("$E/held-$t.jsonl"); done
  rarecache eval report "${gen[@]}" --general-summary $A/general-map-summary.json > $A/general-report.md
  sel=$SEL  # the ladder this queue records
  rarecache eval gate fit "${held[@]}" --arm "ladder/$sel@general" --out $A/gate-policy.json
  rarecache eval gate report "${gen[@]}" --arm "ladder/$sel@general" --policy $A/gate-policy.json \
      --summary $A/gate-summary.json > $A/gate-report.md
  rarecache eval drift run --source $S --target $T --map $GENERAL --arms alone "0.2:$sel" gate \
      --gate-policy $A/gate-policy.json --stories "$1" "${DT[@]}" --out "$E/drift-coqa-$sel.jsonl" > $A/drift-report.md
}
reports 50 || echo "REPORTS FAILED at 100 items; the evaluations go on"
for task in "${TASKS[@]}"; do
  ev $S $T $task 300 $E/general-$task.jsonl $GENERAL
done
reports 200 || echo "REPORTS FAILED at 300 items"
# large -> small on the tasks where the 0.5B is above chance
gen $T $S 65536 $REVERSE
for task in hellaswag arc_challenge; do
  ev $T $S $task 300 $E/general-$task-reverse.jsonl $REVERSE
done
# how the fit moves with the number of positions (held-out R2 on the documents after each fit)
gen $S $T 16384 $M/general-16k-0.5b-to-1.5b.safetensors
gen $S $T 262144 $M/general-256k-0.5b-to-1.5b.safetensors
for f in $E/general-*.jsonl; do  # (held-*.jsonl are the gate's fit data: `eval gate fit`)
  rarecache eval report "$f" --plots docs/artifacts > "${f%.jsonl}.report.md"
  rarecache eval report "$f" --compact > "${f%.jsonl}.compact.md"
done
echo GENERAL DONE
