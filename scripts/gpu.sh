#!/usr/bin/env bash
# The checks that need a GPU, as one short run (docs/PERFORMANCE.md, "On an H200"): the exactness tests on CUDA
# (tests/test_cuda.py), then the handoff against the target's own prefill at the seed paper's shapes (Qwen3-0.6B ->
# 14B, random weights: nothing is downloaded), our prefill against transformers' (so the baseline is known to be a
# fair one), and each optimisation against its reference there. Every speed figure is a ratio to a baseline timed
# in the same process. Most important first: a run cut short keeps what it finished. At most 8 files in $OUT.
#   OUT=/tmp/gpu bash scripts/gpu.sh
# Through this workplace's device tool: the working tree travels whole and may not exceed 64 MiB, and the
# committed maps (docs/artifacts/maps, docs/artifacts/general-v1) are 232 MB, so move those *.safetensors out of
# the tree for the call and back after it. The run of 2026-12-04 took 463 s on an H200.
#   SMOKE=1 bash scripts/gpu.sh     # the same steps on the CPU at toy sizes (one layer), to check the script
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rarecache-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RC=(python3 -c "import sys; from rarecache.cli import main; sys.exit(main())")  # the CLI, not installed there
S=qwen3-0.6b:qwen3-14b
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu; CUT=(--max-layers 1); SHORT=(--lengths 64 --batches 1 2); LONG=(--lengths 128 --batches 1); ABL=(128)
  SUFFIX=("${SHORT[@]}")
  TESTS=(-k "tiny_shapes_do_not_exist"); export RARECACHE_TEST_DEVICE=cpu
else
  DEV=cuda; CUT=(); SHORT=(--lengths 149 512 2048 --batches 1 4 16); LONG=(--lengths 8192 --batches 1); ABL=(2048)
  SUFFIX=(--lengths 149 2048 --batches 1 4 16)
  TESTS=()
fi
G=(--shapes $S --device $DEV --dtype bfloat16 "${CUT[@]}")
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "${TESTS[@]}"; } 2>&1 | tee "$OUT/test_cuda.txt"
handoff() {  # selector grid... (the paper's selector, rank, and the default, suffix, which scores nothing)
  timeout 240 "${RC[@]}" bench handoff "${G[@]}" "${@:2}" --rhos 0.2 0.3 0.5 --selector $1 --repeats 5 \
      --summary "$OUT/handoff-$1-summary.json" 2>&1 | tee -a "$OUT/handoff-$1.txt"
}
baseline() {
  timeout 200 python3 research/scripts/prefill_baseline.py --shape qwen3-14b --device $DEV "${CUT[@]}" "$@" --repeats 3 2>&1 \
      | tee -a "$OUT/prefill-baseline.txt"
}
handoff rank "${SHORT[@]}"
baseline "${SHORT[@]}"
handoff rank "${LONG[@]}"
handoff suffix "${SUFFIX[@]}"
handoff suffix "${LONG[@]}"
for T in "${ABL[@]}"; do
  timeout 150 "${RC[@]}" bench ablate "${G[@]}" --length $T --rho 0.3 --batch 4 --repeats 3 2>&1 | tee -a "$OUT/ablate.txt"
done
baseline "${LONG[@]}"
echo "GPU CHECKS DONE"
