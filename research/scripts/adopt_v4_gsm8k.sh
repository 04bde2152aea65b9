#!/usr/bin/env bash
# Issue #41 item 4, after research/scripts/adopt_v4_rule4.sh: GSM8K exact match (items 0-99) for the arm rule 4
# picked (research/scripts/adopt_rules.py), when it is not the one adopt_v4.sh already ran (suffix 0.2), added to
# the same file as the 1.5B, the 0.5B and v3's served arm. Resumable:
#   nohup bash research/scripts/frozen.sh research/scripts/adopt_v4_gsm8k.sh >> ~/.cache/rarecache/runs/adopt_v4.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/adopt
. research/scripts/lib.sh; V3=$(v3_map)  # served until v4
V4B=$R/maps/general-tok-64k-bf16w.safetensors
arm=$(python research/scripts/adopt_rules.py "$E" | sed -n 's/^Default arm by rule 4: \*\*rho=\(.*\)@v4b\*\*$/\1/p')
[ -n "$arm" ] || { echo "rule 4 picked no arm yet" >&2; exit 1; }
arm=${arm/\//:}
[ "$arm" = 0.2:suffix ] || rarecache eval run --task gsm8k --source $S --target $T --map v3=$V3 v4b="$V4B" \
    --arms target source 0.2:suffix@v3 "$arm@v4b" --limit 100 --batch 10 --dtype bfloat16 --out $E/gsm8k.jsonl > /dev/null
echo "GSM8K FOR $arm DONE"
