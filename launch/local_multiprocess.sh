#!/usr/bin/env bash
# N processes on this machine, one CPU device each, one shared workdir (what a SLURM job on a shared
# filesystem looks like): jax.distributed on localhost, gloo CPU collectives, process 0 writes the
# run's files (docs/architecture.md "Multi-process runs"). If one process fails, the others are
# stopped and the script exits with its status; running the same command again resumes.
#   launch/local_multiprocess.sh N [CONFIG] [WORKDIR] [flags...]
#   launch/local_multiprocess.sh 2 configs/tiny.py runs/tiny2
# Holds no hyperparameters: those live in the config file. PYTHON picks the interpreter (default python3).
set -euo pipefail
N=${1:?usage: launch/local_multiprocess.sh N [CONFIG] [WORKDIR] [flags...]}
CONFIG=${2:-configs/tiny.py}
WORKDIR=${3:-runs/tiny}
shift $(( $# > 3 ? 3 : $# ))
PY=${PYTHON:-python3}
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "N must be a positive integer, got '$N'" >&2; exit 1; }
command -v "$PY" >/dev/null || { echo "$PY not found (set PYTHON)" >&2; exit 1; }
"$PY" -c "import jax, behaviortrace_jax" 2>/dev/null || { echo "behaviortrace_jax or jax is not installed for $PY: pip install -e '.[test]'" >&2; exit 1; }
"$PY" -c "from jax._src.lib import _jax; assert hasattr(_jax, 'make_gloo_tcp_collectives')" 2>/dev/null \
  || { echo "this jaxlib has no gloo CPU collectives; multi-process CPU runs need them" >&2; exit 1; }
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# one CPU device per process: drop a --xla_force_host_platform_device_count the caller may have set
export XLA_FLAGS=$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')
PORT=${COORDINATOR_PORT:-$("$PY" -c "import socket; s=socket.socket(); s.bind(('localhost', 0)); print(s.getsockname()[1])")}
PIDS=()
# SIGTERM first; jax.distributed catches it (a preemption notice), so SIGKILL whatever is left after 5 s
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 5
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  exit 143
}
trap cleanup INT TERM
for ((i = 0; i < N; i++)); do
  "$PY" main.py --config="$CONFIG" --workdir="$WORKDIR" --coordinator_address="localhost:$PORT" \
    --num_processes="$N" --process_id="$i" "$@" &
  PIDS+=($!)
done
STATUS=0
for ((i = 0; i < N; i++)); do
  rc=0
  wait "${PIDS[$i]}" || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "local_multiprocess: process $i exited with status $rc" >&2
    [[ $STATUS -ne 0 ]] || STATUS=$rc
  fi
done
exit $STATUS
