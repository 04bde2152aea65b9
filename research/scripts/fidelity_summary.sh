#!/usr/bin/env bash
# Issue #41's summary file for the served map (v4, label v4b in the records) at the served arm
# (rarecache/defaults.py), with v3 as it was served (suffix 0.2) as `previous`, from the committed adoption
# records alone (research/fidelity/adopt/: MMLU, ARC-Challenge, HellaSwag and passage QA items 0-299, GSM8K
# exact match 0-99, CoQA 50 stories switching every turn; v3's CoQA is research/gate/drift-coqa-v3-50) and
# the probe through both maps. Writes docs/artifacts/fidelity-summary.json (and prints the table).
#   bash research/scripts/fidelity_summary.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
A=research/fidelity/adopt
ARM=$(python -c "from rarecache.defaults import SERVED as s; print(f'{s.rho:g}:{s.selector}')")
rarecache eval report $A/{mmlu,arc_challenge,hellaswag,gsm8k,coqa_passage}.jsonl.gz \
    --drift $A/drift-coqa-v4b-50.jsonl.gz --previous-drift research/gate/drift-coqa-v3-50.jsonl.gz \
    --probe $A/probe.summary.json --arm "$ARM" --previous-arm 0.2:suffix --map-label v4b --previous-label v3 \
    --fidelity-summary docs/artifacts/fidelity-summary.json | sed -n '/^fidelity through map/,$p'
