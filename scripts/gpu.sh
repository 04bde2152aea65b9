#!/usr/bin/env bash
# The checks that need a GPU, as one short run (issue 45; at most 8 minutes on an H100): the exactness tests on
# CUDA (tests/test_cuda.py: FlexAttention and the other kernels against the dense reference, no host sync inside a
# layer), then `rarecache bench gpu`: the handoff at Qwen3-0.6B -> 14B shapes (random weights: nothing is
# downloaded) against the stronger of our prefill and transformers' SDPA prefill over the same weights, timed in
# the same run, T 149/512/2048/8192 x batch 1/4/16 x rho 0.2/0.3/0.5 x rank/suffix. It writes
# $OUT/handoff-summary.json (default OUT: docs/artifacts/gpu-<card>), handoff-detail.json, test_cuda.txt, bench.txt.
#   bash scripts/gpu.sh                 # on a GPU machine; COMPILE=1 adds --compile
#   SMOKE=1 bash scripts/gpu.sh         # the same steps on the CPU at toy shapes, into a temp dir (CI)
# Through this workplace's device tool the working tree travels whole and may not exceed 64 MiB: move the
# committed maps (*.safetensors under docs/artifacts and rarecache/data) out of the tree for the call.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RC=("$PY" -c "import sys; from rarecache.cli import main; sys.exit(main())")  # the CLI, not installed there
if [ -n "${SMOKE:-}" ]; then
  OUT=${OUT:-$(mktemp -d -t rarecache-gpu-smoke.XXXXXX)}
  export RARECACHE_TEST_DEVICE=cpu
  TESTS=(-k "flex or sync"); BENCH=(--smoke); T_TESTS=240; T_BENCH=240  # generous: a loaded CI machine
else
  CARD=$("$PY" -c "import torch; from rarecache.bench.gpu import card_slug; print(card_slug(torch.cuda.get_device_name()))") \
    || { echo "no CUDA GPU here (SMOKE=1 runs on the CPU)"; exit 2; }
  OUT=${OUT:-docs/artifacts/gpu-$CARD}
  TESTS=(); BENCH=(); T_TESTS=120; T_BENCH=330
  [ -n "${COMPILE:-}" ] && BENCH+=(--compile)
fi
mkdir -p "$OUT"
status=0
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout $T_TESTS "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py "${TESTS[@]}"; } 2>&1 | tee "$OUT/test_cuda.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "CUDA TESTS FAILED"; status=1; }
timeout $T_BENCH "${RC[@]}" bench gpu --out "$OUT" "${BENCH[@]}" 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "BENCH FAILED"; status=1; }
echo "GPU CHECKS DONE ($OUT, status $status)"
exit $status
