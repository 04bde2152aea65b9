#!/usr/bin/env bash
# Issue #41's summary file for the served map (v3) and arm (suffix, rho 0.2), from the committed records
# alone: MMLU 300 items, ARC-Challenge and HellaSwag 100, GSM8K exact match 100 (bf16 screen files, where
# every arm ran on the same items), passage QA (coqa_passage) 100, and CoQA conversations (50 stories
# switching model at every turn, no healing) from the gate's drift file. Writes
# docs/artifacts/fidelity-summary.json (and prints the table). A candidate map's summary adds its label with
# --map-label and v3 as --previous-label (research/fidelity/screen-v*-100.json).
#   bash research/scripts/fidelity_summary.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
R=research/fidelity/runs
rarecache eval report $R/fid-mmlu-300.jsonl.gz $R/fid-arc_challenge-100.jsonl.gz $R/fid-hellaswag-100.jsonl.gz \
    docs/artifacts/gsm8k-em-v3-100.jsonl.gz $R/fid-coqa_passage-100.jsonl.gz \
    --drift research/gate/drift-coqa-v3-50.jsonl.gz --fidelity-summary docs/artifacts/fidelity-summary.json \
    --arm 0.2:suffix --map-label v3 | sed -n '/^fidelity through map/,$p'
