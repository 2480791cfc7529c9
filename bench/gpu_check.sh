#!/usr/bin/env bash
# The device check of issue 12, as one script: the compile stage for the attached GPU (target=local)
# at Qwen2.5-1.5B (28 layers, paper config) and bench/bench_sketcher.py --gpu. Writes under $OUT
# (or ./gpu_check). Needs jax with a CUDA plugin; on the lent H200 image, ml-collections and
# tensorboardX travel as wheels in .whl/ (README of the device tool).
#     bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 BEHAVIORTRACE_MALLOC_TUNING=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
timeout "${COMPILE_TIMEOUT:-330}" python3 main.py --config=configs/seed0.py --config.stages=compile \
  --config.compile.target=local --config.compile.model=qwen2p5_1p5b --workdir="$OUT/compile" \
  > "$OUT/compile.log" 2>&1; echo "compile stage exit $?" | tee -a "$OUT/gpu.txt"
cp "$OUT/compile/compile_report.md" "$OUT/compile/compile_report.json" "$OUT/" 2>/dev/null
tail -25 "$OUT/compile.log"
timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_sketcher.py --gpu --reps 3 --chunks 4,8 > "$OUT/bench_sketcher.log" 2>&1
echo "bench_sketcher exit $?" | tee -a "$OUT/gpu.txt"
tail -15 "$OUT/bench_sketcher.log"
rm -rf "$OUT/compile"
