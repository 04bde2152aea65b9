#!/usr/bin/env bash
# The general map (#15): every long CPU run behind research/LOG.md §8, in priority order. Idempotent and
# resumable like results.sh: a map that exists is kept, a calibration resumes from its .state, an evaluation
# resumes from its results file. Run it in the background and rerun it after an interruption:
#   nohup bash research/scripts/frozen.sh research/scripts/general.sh >> ~/.cache/rarecache/runs/general.log 2>&1 &
# Maps, states and results go to $RUNS (default ~/.cache/rarecache/runs): outside the work tree, so a fresh
# checkout on the same machine continues them. On a fresh machine the general maps are the ones the committed runs
# went through, no longer in the tree: put them in $RARECACHE_HOME/maps first (lib.sh's REBUILT; docs/RESULTS.md,
# "Maps that are no longer in the tree": `git show` gives their exact bytes), and an evaluation continues from its
# partial run committed to docs/artifacts (research/scripts/publish.sh; lib.sh). Without them it calibrates anew,
# and the committed runs, pinned to the old maps' sha256, are not continued.
# frozen.sh runs it from a copy of HEAD, so editing the work tree (this file included) cannot change what a
# running queue does.
# Breadth first: every task, the gate's ladders and reports, large -> small and the 16k map's figures at 100
# items, then all of it continues to 300 (the same files: --limit grows), so an interrupted queue still has
# every figure at a stated n. float32: on CPUs without AVX-512 BF16 it is the faster
# dtype (this machine: 4.6x faster than bf16). RUNS=DIR puts maps and results elsewhere.
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; E=$R/eval
mkdir -p $M $E
DT=(--dtype float32)
gen() {  # source target tokens out (the preset's sequence length and sharpening: eval/mix.py)
  [ -f "$4" ] || rarecache calibrate --source "$1" --target "$2" --preset general-v2 --tokens "$3" \
      --heldout-tokens 8192 "${DT[@]}" --out "$4"
}
# Two fits of the same statistics (research/LOG.md 8.1): the sharpened map (keys R2^-1, values R2^-0.5) the preset made
# when the 64k map was calibrated, which makes plain transfer (rho 0) nearly level with the source, and its plain
# ridge fit, which serves the handoffs (rho > 0) better. Handoff arms go through the ridge fit (label ridge); plain
# transfer through both (0:rank@ridge, 0:rank@sharp). The ridge fit is the sharpened map's sharpening undone
# exactly (refit --sharpen 0 0, no state; byte for byte). The served file (SERVED, served until v3) is the ridge fit
# recording plain transfer's sharpening (refit --plain-sharpen): the summary checks it against both. Maps the
# preset makes now are such files already (ridge + plain_sharpen), so the reverse map is evaluated through
# itself alone (label general: plain transfer through its plain view, handoffs through its fit).
SHARP=$M/general-64k-0.5b-to-1.5b.safetensors
RIDGE=$M/general-64k-ridge.safetensors
SERVED=$M/general-64k.safetensors
REVERSE=$M/general-64k-1.5b-to-0.5b.safetensors
ridge() { [ -f "$2" ] || rarecache refit --map "$1" --sharpen 0 0 --out "$2"; }  # sharp ridge
served_form() {  # MAP: a map made by an older preset (sharpened whole) turned into the served form, in place
  local rc=0
  python -c "import sys; from rarecache.transfer.mapper import Mapper; sys.exit(0 if Mapper.load(sys.argv[1]).has_plain_view else 3)" \
      "$1" || rc=$?
  [ $rc = 3 ] || return $rc  # 0: already served form; else the map does not load
  rarecache refit --map "$1" --sharpen 0 0 --plain-sharpen 1 0.5 --out "$1.served"
  mv "$1.served" "$1"
}
# the issue's arms, in two passes so that every task reaches the acceptance budget (rho 0.2) early: pass A is
# everything at 0.2 (and the issue's suffix 0.3), pass B the 0.1 / 0.3 arms. suffix+attn is the combined
# selector (the newest positions and the most attended ones, in turn); attn+rank, the first combined selector,
# lost to both its parts on MMLU (research/LOG.md 8) and was dropped after MMLU and 14 HellaSwag items for CPU time
# (every arm costs its continuations: a 441-token HellaSwag item takes ~7 s per arm here). The gate's ladder
# runs once the default selector is known: the one the general summary picks from passes A and B.
PASS_A=(target source 0:rank@ridge 0:rank@sharp 0.2:rank@ridge 0.2:attn-source@ridge 0.2:suffix@ridge
        0.3:suffix@ridge 0.2:suffix+attn@ridge)
PASS_B=(0.1:rank@ridge 0.3:rank@ridge 0.1:attn-source@ridge 0.3:attn-source@ridge 0.1:suffix@ridge
        0.1:suffix+attn@ridge 0.3:suffix+attn@ridge)
. research/scripts/lib.sh  # seed, shipped, gate_side_fits
ev() {  # source target task items out ridge-map sharp-map start arms...
  seed "$5"
  rarecache eval run --task "$3" --source "$1" --target "$2" --map "ridge=$6" "sharp=$7" "served=$SERVED" --arms "${@:9}" \
      --start "$8" --limit "$4" "${DT[@]}" --out "$5" >/dev/null
}
ev_one() {  # source target task items out map start arms... (label general)
  seed "$5"
  rarecache eval run --task "$3" --source "$1" --target "$2" --map "general=$6" --arms "${@:8}" \
      --start "$7" --limit "$4" "${DT[@]}" --out "$5" >/dev/null
}
ONE=("${PASS_A[@]/@ridge/@general}" "${PASS_B[@]/@ridge/@general}")
ONE=("${ONE[@]/0:rank@sharp}")  # (the served file's plain view is the sharpened plain transfer)
ONE=(${ONE[@]})
TASKS=(gsm8k_bpb mmlu arc_challenge hellaswag)  # GSM8K first: where plain transfer lost to the source (research/LOG.md 8)
shipped $SHARP
gen $S $T 65536 $SHARP
shipped $RIDGE
ridge $SHARP $RIDGE
shipped $SERVED
[ -f $SERVED ] || rarecache refit --map $RIDGE --plain-sharpen 1 0.5 --out $SERVED
for pass in A B; do
  [ $pass = A ] && arms=("${PASS_A[@]}") || arms=("${PASS_B[@]}")
  for task in "${TASKS[@]}"; do
    ev $S $T $task 100 $E/ridge-$task.jsonl $RIDGE $SHARP 0 "${arms[@]}"
  done
done
A=$R/artifacts; mkdir -p $A
gen_paths() { local t; for t in "${TASKS[@]}"; do echo "$E/$1-$t.jsonl"; done; }
default_selector() {  # the general summary's pick over every task's results so far (through the ridge fit)
  rm -f $A/general-map-summary.json  # (inside $(...) errexit is off: a failed report must not leave a stale pick)
  rarecache eval report $(gen_paths ridge) --general-summary $A/general-map-summary.json --map-label ridge \
      --plain-label sharp --served-map $SERVED > $A/general-report.md || return 1
  python -c "import json,sys; print(json.load(open(sys.argv[1]))['default_selector'])" $A/general-map-summary.json
}
# what the numbers so far say: the gate's policy fitted on held-apart items (300-399, never evaluated) with the
# default selector's ladder, its outcome on the evaluated items, CoQA drift through it. The ladders run through
# the served file itself (label served; its rungs map with its stored fit, the ridge one), so the policy records
# the sha256 `serve --rho auto` checks.
reports() {  # selector stories items (called as `reports ... || echo`, where errexit is off: the steps are chained)
  rm -f $A/gate-policy.json $A/gate-report.md $A/gate-summary.json  # nothing stale beside a new policy
  local drift=()  # (stories 0: the policy and its report on the four tasks only)
  rarecache eval gate fit $(gen_paths ridge-held) --arm "ladder/$1@served" --out $A/gate-policy.json \
      > $A/gate-fit.txt || return 1  # (what it prints: each task's outcome and the signal's held-apart AUC)
  if [ "$2" != 0 ]; then
    seed "$E/drift-coqa-$1-n$3.jsonl"  # (a committed drift run continues: its rows are not recomputed)
    if rarecache eval drift run --source $S --target $T --map $SERVED --arms alone "0.2:$1" gate \
        --gate-policy $A/gate-policy.json --stories "$2" "${DT[@]}" --out "$E/drift-coqa-$1-n$3.jsonl" > $A/drift-report.md
    then drift=(--drift "$E/drift-coqa-$1-n$3.jsonl")
    else echo "DRIFT FAILED; the gate report goes on without CoQA"
    fi
  fi
  rarecache eval gate report $(gen_paths ridge) --arm "ladder/$1@served" --policy $A/gate-policy.json "${drift[@]}" \
      --summary $A/gate-summary.json > $A/gate-report.md || return 1
  gate_side_fits "ladder/$1@served" $E $E $A $A  # each task's own policy and the accuracy-loss fit (lib.sh)
}
SEL=$(default_selector)
# the ladders breadth first too: 50 evaluated and 50 held items of every task give a first policy and its
# report, with CoQA through it on 10 stories; then 100 of each without CoQA (the fit falls back on every
# request, so more stories would measure the target against itself); CoQA grows at 300 below
# (a drift file records the gate rule its rows were run with and refuses another: one file per policy, named by
# the items it was fitted on). A CoQA story costs minutes per arm here, so the story counts are small.
gate() {  # items: the ladders of every task to that many evaluated and held items, then the reports
  for task in mmlu arc_challenge hellaswag gsm8k_bpb; do  # the cheapest ladders first (GSM8K's ~830-token prompts last)
    ev $S $T $task $1 $E/ridge-$task.jsonl $RIDGE $SHARP 0 ladder:$SEL@served
    ev $S $T $task $1 $E/ridge-held-$task.jsonl $RIDGE $SHARP 300 target ladder:$SEL@served
  done
  [ $1 = 50 ] && stories=10 || stories=0  # (at 100: the four tasks' report only. The fit at 50 fell back on every
  # request, which makes CoQA's gate arm the target alone, and its drift at 0.2:suffix is measured on 10 stories
  # already; CoQA grows at 300, after the reverse map. research/LOG.md 9)
  reports $SEL $stories $1 || echo "REPORTS FAILED at $1 items; the evaluations go on"
}
gate 50
# #15's acceptance at the issue's 300 items before anything else grows: the four arms its two criteria read (the
# default at rho 0.2, plain transfer through the served file's plain view, the source, the target). At 100 items
# HellaSwag's gap closed (73%) and GSM8K's plain transfer against the source (-0.009 bpb, CI -0.033 to +0.013)
# decide the criteria and neither is significant, so those two go first. The other arms follow at 300 below;
# a report reads each figure over the items its arms share (eval/summary.py records that n).
ACCEPT=(target source 0:rank@sharp 0.2:$SEL@ridge)
for task in hellaswag gsm8k_bpb arc_challenge mmlu; do
  ev $S $T $task 300 $E/ridge-$task.jsonl $RIDGE $SHARP 0 "${ACCEPT[@]}"
done
gate 100
# breadth first: every figure the issues ask for at 100 items before any at 300. Large -> small on the tasks
# where the 0.5B is above chance; how the fit moves with the number of positions (held-out R2 on the
# documents after each fit, and each map's prefix perplexity: plain transfer, so through the sharpened maps)
gen $T $S 65536 $REVERSE
served_form $REVERSE
for task in hellaswag arc_challenge; do
  ev_one $T $S $task 100 $E/general-$task-reverse.jsonl $REVERSE 0 "${ONE[@]}"
done
ppl() {  # map name (prefix perplexity through it, as maps.sh did for v1's maps)
  [ -f $A/ppl-$1.json ] || rarecache ppl --source $S --target $T --map $M/$1-0.5b-to-1.5b.safetensors \
      --passages 12 --prefix 256 --continuation 256 "${DT[@]}" --out $A/ppl-$1.json
}
gen $S $T 16384 $M/general-16k-0.5b-to-1.5b.safetensors
ppl general-16k; ppl general-64k
for task in "${TASKS[@]}"; do
  ev $S $T $task 300 $E/ridge-$task.jsonl $RIDGE $SHARP 0 "${PASS_A[@]}" "${PASS_B[@]}" ladder:$SEL@served
done
[ "$(default_selector)" = "$SEL" ] || echo "THE DEFAULT SELECTOR MOVED at 300 items; the ladder is $SEL's"
reports $SEL 200 300 || echo "REPORTS FAILED at 300 items"
for task in hellaswag arc_challenge; do
  ev_one $T $S $task 300 $E/general-$task-reverse.jsonl $REVERSE 0 "${ONE[@]}"
done
gen $S $T 262144 $M/general-256k-0.5b-to-1.5b.safetensors
ppl general-256k
for f in $E/ridge-*.jsonl $E/general-*-reverse.jsonl; do  # (ridge-held-*.jsonl: the gate's fit data, `eval gate fit`)
  case "$f" in *ridge-held-*|*.timings.jsonl) continue;; esac
  plain=(); case "${f##*/}" in ridge-*) plain=(--plain-label sharp);; esac  # the served file's plain transfer
  rarecache eval report "$f" "${plain[@]}" --plots docs/artifacts > "${f%.jsonl}.report.md"
  rarecache eval report "$f" "${plain[@]}" --compact > "${f%.jsonl}.compact.md"
done
echo GENERAL DONE
