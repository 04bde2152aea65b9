#!/usr/bin/env bash
# Issue #44 item 4, CoQA through the gate: 50 stories switching model at every turn (no healing), through the
# served map (v3) and selector, bf16: the target alone, the served handoff (suffix 0.2) and the gate arm with
# the policy fitted on the held-apart ladders (research/gate/held-*-200, nll, at most 1% changed answers:
# docs/artifacts/gate-policy.json, written here when missing exactly as research/scripts/gate_artifacts.sh
# writes it). Resumable (`eval drift run` continues its file). Run from a frozen copy:
#   nohup bash research/scripts/frozen.sh research/scripts/gate_coqa.sh >> ~/.cache/rarecache/runs/gate-coqa.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
. research/scripts/lib.sh  # v3_map: v3, served until v4
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/eval; mkdir -p $E
P=${POLICY:-docs/artifacts/gate-policy.json}
[ -f "$P" ] || rarecache eval gate fit research/gate/held-{mmlu,arc_challenge,hellaswag}-200.jsonl.gz --signal nll \
    --out "$P" > /dev/null
rarecache eval drift run --source $S --target $T --map "$(v3_map)" \
    --arms alone 0.2:suffix gate --gate-policy "$P" --stories ${STORIES:-50} --dtype bfloat16 \
    --out $E/drift-coqa-v3-${STORIES:-50}.jsonl
echo GATE-COQA DONE
