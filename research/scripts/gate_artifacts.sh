#!/usr/bin/env bash
# The quality gate's figures (research/LOG.md 9) from the committed runs alone, so anyone can rerun them from a
# checkout: the policy fitted on the published held-apart ladders, its report on the published evaluated ladders
# with CoQA from the published drift file (the summary file written by the report command itself), each task's
# own policy, and the accuracy-loss fit. Reads docs/artifacts/ridge-held-TASK-HELD.jsonl.gz,
# ridge-TASK-EVAL.jsonl.gz and DRIFT.jsonl.gz (with their .meta.json and timings); writes docs/artifacts/gate-*.
#   bash research/scripts/gate_artifacts.sh [HELD] [EVAL] [DRIFT]   (defaults: 50 100 drift-coqa-suffix-n50)
# A run still going is published first with research/scripts/publish.sh (and the drift file as below).
set -euo pipefail
cd "$(dirname "$0")/../.."
HELD=${1:-50}; EVAL=${2:-100}; DRIFT=${3:-drift-coqa-suffix-n50}
A=docs/artifacts; TASKS=(gsm8k_bpb mmlu arc_challenge hellaswag)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
unpack() {  # artifact-name local-name: the results file, its timings and run record under $tmp
  gzip -dc "$A/$1.jsonl.gz" > "$tmp/$2.jsonl"
  [ ! -f "$A/$1.timings.jsonl.gz" ] || gzip -dc "$A/$1.timings.jsonl.gz" > "$tmp/$2.timings.jsonl"
  cp "$A/$1.meta.json" "$tmp/$2.meta.json"
}
for t in "${TASKS[@]}"; do
  unpack ridge-held-$t-$HELD ridge-held-$t
  unpack ridge-$t-$EVAL ridge-$t
done
unpack "$DRIFT" drift
SEL=$(python -c "import json; print(json.load(open('$A/general-map-summary-v2.json'))['default_selector'])")
ARM=ladder/$SEL@served
held=(); ev=(); for t in "${TASKS[@]}"; do held+=("$tmp/ridge-held-$t.jsonl"); ev+=("$tmp/ridge-$t.jsonl"); done
rarecache eval gate fit "${held[@]}" --arm $ARM --out $A/gate-policy.json > $A/gate-fit.txt
rarecache eval drift report "$tmp/drift.jsonl" > $A/drift-report.md
rarecache eval gate report "${ev[@]}" --arm $ARM --policy $A/gate-policy.json --drift "$tmp/drift.jsonl" \
    --summary $A/gate-summary.json > $A/gate-report.md
. research/scripts/lib.sh
gate_side_fits $ARM "$tmp" "$tmp" $A "$tmp"  # each task's own policy and the accuracy-loss fit (not committed)
# the reports name the temporary copies; say which artifacts they were
sed -i "s#$tmp/#docs/artifacts (unpacked): #g" $A/gate-*.md $A/gate-fit.txt $A/drift-report.md
echo "wrote $A/gate-policy.json gate-summary.json gate-report.md gate-fit.txt gate-report-per-task.md" \
     "gate-report-accuracy.md drift-report.md"
