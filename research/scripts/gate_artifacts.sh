#!/usr/bin/env bash
# The quality gate's figures (research/LOG.md §12, §14) from the committed records alone, so anyone can rerun them
# from a checkout: the policy fitted on the held-apart ladders through the served map (research/gate/held-TASK-200:
# items 300-499, every rung a direct handoff, signal nll, at most 1% changed answers), its report on the evaluated
# items' ladders (research/gate/eval-TASK-100: items 0-99) with CoQA from the drift run through that policy
# (research/gate/drift-coqa-v3-50), the summary file written by the report command itself.
#   bash research/scripts/gate_artifacts.sh
# The records come from research/scripts/gate_held.sh (START=300, then START=0 N=100) and gate_coqa.sh, published
# with research/scripts/publish.sh. (Before 2026-12-06 this script read v2's ridge-* ladders: git history.)
set -euo pipefail
cd "$(dirname "$0")/../.."
A=docs/artifacts; G=research/gate; TASKS=(mmlu arc_challenge hellaswag)
held=(); ev=(); for t in "${TASKS[@]}"; do held+=("$G/held-$t-200.jsonl.gz"); ev+=("$G/eval-$t-100.jsonl.gz"); done
rarecache eval gate fit "${held[@]}" --signal nll --out $A/gate-policy.json > $A/gate-fit.txt
rarecache eval drift report $G/drift-coqa-v3-50.jsonl.gz > $A/drift-report.md
rarecache eval gate report "${ev[@]}" --policy $A/gate-policy.json --drift $G/drift-coqa-v3-50.jsonl.gz \
    --summary $A/gate-summary.json > $A/gate-report.md
# the same signal fitted on the accuracy lost instead (a right-to-wrong flip offsets a wrong-to-right one): the
# policy goes to a temporary file, its fit and report to gate-report-accuracy.md
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
{ rarecache eval gate fit "${held[@]}" --signal nll --loss accuracy --out $tmp/p.json && echo &&
  rarecache eval gate report "${ev[@]}" --policy $tmp/p.json; } > $A/gate-report-accuracy.md
echo "wrote $A/gate-policy.json gate-summary.json gate-report.md gate-fit.txt drift-report.md gate-report-accuracy.md"
