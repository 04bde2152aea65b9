#!/usr/bin/env bash
# The candidate general mix v3 (research/LOG.md 8.3: v2 and few-shot chains of GSM8K's held-apart word problems)
# against the served file (v2), before it may replace it. Step 1, here: plain transfer, the arm #15's second
# criterion reads, through both maps' plain views on held-apart items 300-(300+N) of every task (never
# evaluated; N=100 is what RESULTS reports), beside the source. Then a person reads it and, if v3 may replace v2,
# runs step 2 (STEP2=1): the acceptance arms through v3 on items 0-299. (The rule set first, no worse than the
# source on every held task, failed on MMLU for v3 and v2 alike, where plain transfer's accuracy is a letter
# prior; research/LOG.md 8.3 says why step 2 ran anyway.) Resumable like general.sh.
#   N=100 nohup bash research/scripts/frozen.sh research/scripts/general_v3.sh >> ~/.cache/rarecache/runs/general_v3.log 2>&1 &
#   STEP2=1 N=100 nohup bash research/scripts/frozen.sh research/scripts/general_v3.sh >> ... (step 1 is then already done)
#   STEP3=1 STEP2=1 N=100 nohup bash research/scripts/frozen.sh research/scripts/general_v3.sh >> ... (steps 1 and 2 then done)
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval
mkdir -p $M $E
V3=$M/general-v3-64k.safetensors
. research/scripts/lib.sh
# v2, the file served until 2026-12-05, no longer in the tree: $RARECACHE_V2_MAP, else where it is put back
# (lib.sh's REBUILT). `git show d7eaf97:docs/artifacts/maps/general-64k.safetensors > FILE` gives its exact bytes
# (sha256 ac9b6bf9...); docs/RESULTS.md, "Maps that are no longer in the tree", the commands that make it again.
SERVED=${RARECACHE_V2_MAP:-$REBUILT/general-64k.safetensors}
[ -f "$SERVED" ] || { echo "general_v3.sh: no v2 map at $SERVED (see docs/RESULTS.md, 'Maps that are no longer in the tree')" >&2; exit 1; }
shipped $V3  # the committed v3 map (the one every published v3 figure went through), where RUNS has none
[ -f $V3 ] || rarecache calibrate --preset general-v3 --source $S --target $T --tokens 65536 --heldout-tokens 8192 \
    --dtype float32 --keep-state --out $V3
for task in gsm8k_bpb arc_challenge mmlu hellaswag; do  # GSM8K first: the task v3 is for
  rarecache eval run --task $task --source $S --target $T --map v3=$V3 v2=$SERVED --arms source 0:rank@v3 0:rank@v2 \
      --start 300 --limit "${N:-50}" --dtype float32 --out $E/v3-held-$task.jsonl > /dev/null
done
# Step 2, once step 1 says v3 may replace v2 (a person reads it: STEP2=1): #15's criteria through v3 on the
# evaluated items 0-299, in the order they decide: plain transfer on every task (criterion 2), then the default
# selector at rho 0.2 on GSM8K, ARC-C and HellaSwag (criterion 1), then the rest of the ladder of budgets the
# summary reads (at 100 items, as v2's pick did; only the default selector: the summary through v3 picks among
# the selectors run through it). The arms go into the served file's results (ridge-TASK.jsonl, label v3): their target
# and source rows are map-free and shared, and `eval report FILES --general-summary OUT --map-label v3` reads
# v3's arms alone. Do not run it while general.sh writes the same files. Publish each map's arms apart, so that a
# committed run seeds only where its maps exist:
#   LABELS=v3 bash research/scripts/publish.sh $E/ridge-TASK.jsonl v3-TASK-300
#   LABELS=ridge,sharp,served bash research/scripts/publish.sh $E/ridge-TASK.jsonl ridge-TASK-300
[ "${STEP2:-0}" = 1 ] || exit 0
SEL=$(python -c "import json; print(json.load(open('docs/artifacts/general-map-summary.json'))['default_selector'])")
v3() {  # items task arms...
  seed $E/ridge-$2.jsonl  # (a fresh machine continues the served file's committed run where its maps are in
  # $M, lib.sh: its target and source rows; the v3 arms published apart, v3-TASK-300, are recomputed)
  rarecache eval run --task $2 --source $S --target $T --map v3=$V3 --arms target source "${@:3}" \
      --limit $1 --dtype float32 --out $E/ridge-$2.jsonl > /dev/null
}
for task in gsm8k_bpb arc_challenge mmlu hellaswag; do v3 300 $task 0:rank@v3; done
for task in gsm8k_bpb arc_challenge hellaswag; do v3 100 $task 0.2:$SEL@v3; done  # breadth first
for task in hellaswag arc_challenge gsm8k_bpb; do v3 300 $task 0.2:$SEL@v3; done  # at 100: HS 83%, ARC-C 117%, GSM8K 135%
for task in gsm8k_bpb arc_challenge hellaswag mmlu; do v3 100 $task {0.1,0.2,0.3}:$SEL@v3; done
# Step 3 (STEP3=1): v2's runner-up selector (suffix+attn, research/LOG.md 8) through v3 at the same budgets and items,
# so that the summary through v3 picks its default between two selectors, by the numbers, not by inheritance.
[ "${STEP3:-0}" = 1 ] || exit 0
for task in gsm8k_bpb arc_challenge hellaswag mmlu; do v3 100 $task {0.1,0.2,0.3}:suffix+attn@v3; done
