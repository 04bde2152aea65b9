#!/usr/bin/env bash
# The general map's structure and size figures (#15, research/LOG.md 8): the 16k-position general map, dense and
# head-matched from the same positions (refit from the dense run's kept statistics) (the dense one is also the 16k point of R2 against positions), and the
# prefix perplexity of each. Resumable like general.sh (a map that exists is kept, a calibration resumes
# from its .state). While it runs the general queue is paused (SIGSTOP), so both get whole cores; it is
# continued at the end, also when this script fails.
#   nohup bash research/scripts/frozen.sh research/scripts/maps.sh >> ~/.cache/rarecache/runs/maps.log 2>&1 &
set -euxo pipefail
cd "$(dirname "$0")/../.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
R=${RUNS:-$HOME/.cache/rarecache/runs}; M=$R/maps; A=$R/artifacts
mkdir -p $M $A
queue=$(pgrep -f "frozen-general/research/scripts/general.sh" | head -1 || true)
[ -n "$queue" ] && kill -STOP -- -"$(ps -o pgid= "$queue" | tr -d ' ')"
trap '[ -n "$queue" ] && kill -CONT -- -"$(ps -o pgid= "$queue" | tr -d " ")"' EXIT
gen() {  # out tokens [flags...]
  [ -f "$1" ] || rarecache calibrate --source $S --target $T --preset general-v2 --tokens "$2" --heldout-tokens 8192 \
      --dtype float32 --out "$1" "${@:3}"
}
gen $M/general-16k-0.5b-to-1.5b.safetensors 16384 --keep-state
H=$M/general-16k-heads-0.5b-to-1.5b.safetensors  # the same positions' head blocks: no second pass over data
[ -f $H ] || rarecache refit --map $M/general-16k-0.5b-to-1.5b.safetensors --head-matched --out $H
for m in general-16k general-16k-heads general-64k; do
  [ -f $A/ppl-$m.json ] || rarecache ppl --source $S --target $T --map $M/$m-0.5b-to-1.5b.safetensors \
      --passages 12 --prefix 256 --continuation 256 --dtype float32 --out $A/ppl-$m.json
done
# the mapping paper's diagnostics (seed 002 4.5) through the general map, on a few-shot and a 0-shot task
G=$M/general-64k-0.5b-to-1.5b.safetensors
for task in hellaswag mmlu; do
  [ -f $A/diagnose-general-$task.txt ] || rarecache inspect $G --diagnose $task --source $S --target $T \
      --prompts 8 --rho 0.2 --dtype float32 --diagnose-plot $A/diagnose-general-$task.png > $A/diagnose-general-$task.txt
done
# the nonlinear option (4.4) on the 16k general map, against its ridge on held-out positions
[ -f $M/general-16k-mlp-0.5b-to-1.5b.safetensors ] || rarecache mlp $M/general-16k-0.5b-to-1.5b.safetensors \
    --source $S --target $T --preset general-v2 --tokens 8192 --heldout-tokens 4096 --dtype float32 \
    --out $M/general-16k-mlp-0.5b-to-1.5b.safetensors > $A/mlp-general-16k.txt
echo MAPS DONE
