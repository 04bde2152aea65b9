#!/usr/bin/env bash
# ADOPTION.md rules 14-16: `query-refine` (a refining pass reads the question's attention again) and
# `attn-source-span-raw` (the sinks ranked) at rho 0.3 through
# v4 (sha 7145adb2), beside the served span's committed rows, each file started from them so only the new arm runs.
#   step screen: rule 14 (i), multidoc_qa T 2048 items 0-49 (rows from research/fidelity/mdceil)
#   step 4096:   rule 14 (ii), multidoc_qa T 4096 items 30-59 (rows from research/fidelity/rule11, rule 13's)
#   step 1024:   rule 14 (ii), multidoc_qa T 1024 items 0-99 (rows from research/fidelity/rule11)
#   step decompose: a diagnostic (no rule): `attn-source` on step screen's items
#   step sinks:  rule 15 (i), `attn-source-span-raw` on step screen's items
#   step window: a diagnostic (no rule): `query` (window 32) and the oracle at rho 0.2 on step screen's items
#   step blend:  rule 16 (i), `query-blend` on step screen's items
# Read: python research/scripts/longctx_rules.py 9 RUNS/refine/<file> --arms <span> <refine> --served <span>
#   nohup bash research/scripts/refine.sh screen > ~/.cache/rarecache/runs/refine-screen.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; E=$R/refine; mkdir -p $E
V4=rarecache/data/general-v4-64k.safetensors
. research/scripts/lib.sh
D=research/fidelity/refine
from() {  # from NAME DIR [FILE]: start RUNS/refine/NAME from DIR's FILE (default NAME), unless committed here
  if [ -f $D/$1.jsonl.gz ]; then seed_from $E $1 $D; else seed_as $E $1 $2 ${3:-$1}; fi
}
ARMS="target source 0.3:attn-source-span@v4b 0.3:query-refine@v4b"
case ${1:?step screen, 4096, 1024, decompose, sinks, window or blend} in
  screen) from multidoc_qa-2048 research/fidelity/mdceil
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 --arms $ARMS \
         --limit 50 --threads 2 --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  4096) from multidoc_qa-4096 research/fidelity/rule11 r13-multidoc_qa-4096
     rarecache eval run --task multidoc_qa --length 4096 --source $S --target $T --map v4b=$V4 --arms $ARMS \
         --start 30 --limit 30 --threads 2 --out $E/multidoc_qa-4096.jsonl > /dev/null;;
  1024) from multidoc_qa-1024 research/fidelity/rule11
     rarecache eval run --task multidoc_qa --length 1024 --source $S --target $T --map v4b=$V4 --arms $ARMS \
         --limit 100 --threads 2 --out $E/multidoc_qa-1024.jsonl > /dev/null;;
  decompose) # a diagnostic after rule 14 (i) failed, no rule: the oracle's recipe (plain top tokens, sinks ranked)
     # with the 0.5B's attention (`attn-source`), beside the span (the same attention with +-8 spans, sinks out)
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 \
         --arms $ARMS 0.3:attn-source@v4b --limit 50 --threads 2 --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  sinks) # ADOPTION.md rule 15 (i): the served span with the sinks ranked, on step screen's items
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 \
         --arms $ARMS 0.3:attn-source@v4b 0.3:attn-source-span-raw@v4b --limit 50 --threads 2 \
         --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  window) # a diagnostic after rules 14-15 (no rule): `query` (window 32 over mapped rows) and the oracle at rho 0.2
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 \
         --arms $ARMS 0.3:attn-source@v4b 0.3:attn-source-span-raw@v4b 0.3:query@v4b 0.2:attn-target@v4b \
         --limit 50 --threads 2 --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  blend) # ADOPTION.md rule 16 (i): `query-blend`, on step screen's items
     rarecache eval run --task multidoc_qa --length 2048 --source $S --target $T --map v4b=$V4 \
         --arms $ARMS 0.3:attn-source@v4b 0.3:attn-source-span-raw@v4b 0.3:query@v4b 0.2:attn-target@v4b \
         0.3:query-blend@v4b --limit 50 --threads 2 --out $E/multidoc_qa-2048.jsonl > /dev/null;;
  *) echo "unknown step $1: screen, 4096, 1024, decompose, sinks, window or blend" >&2; exit 2;;
esac
