#!/usr/bin/env bash
# The device check of issue 34 (item 5), as one script of at most ~8 min: a paper-shaped Qwen2.5-1.5B
# GRPO step (random weights, bfloat16, configs/seed0.py's batch shape, one device) timed plain, fused on
# the XLA path (splitmix64 and block hash) and fused with the Pallas kernel (TPU only; reported as
# skipped on a GPU): median ms, program and peak memory, ratios to plain (bench/gpu_step_check.py;
# its --tiny CPU run is tests/repo/test_gpu_step_check.py). Writes under $OUT (or ./gpu_check). Needs jax
# with the device's plugin; on the lent image, ml-collections and tensorboardX travel as wheels in .whl/.
#     bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 BEHAVIORTRACE_MALLOC_TUNING=0
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true) | tee "$OUT/device.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  | tee -a "$OUT/device.txt"
timeout "${STEP_TIMEOUT:-440}" python3 bench/gpu_step_check.py --rounds "${ROUNDS:-5}" --steps "${STEPS:-3}" \
  > "$OUT/gpu_step_check.log" 2>&1
echo "gpu_step_check exit $?" | tee -a "$OUT/device.txt"
grep -v "^W0\|^I0" "$OUT/gpu_step_check.log" | tail -12
