#!/usr/bin/env bash
# Local single-process run on this machine's CPU (the tiny default).
#   launch/local_cpu.sh [CONFIG] [WORKDIR] [flags...]
# Holds no hyperparameters: those live in the config file.
set -euo pipefail
CONFIG=${1:-configs/tiny.py}
WORKDIR=${2:-runs/tiny}
shift $(( $# > 2 ? 2 : $# ))
command -v python3 >/dev/null || { echo "python3 not found" >&2; exit 1; }
python3 -c "import behaviortrace_jax" 2>/dev/null || { echo "behaviortrace_jax is not installed: pip install -e '.[test]'" >&2; exit 1; }
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec python3 main.py --config="$CONFIG" --workdir="$WORKDIR" "$@"
