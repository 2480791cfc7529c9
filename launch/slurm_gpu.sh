#!/usr/bin/env bash
# SLURM: one process per GPU across the allocation; jax.distributed.initialize() reads SLURM_*.
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 launch/slurm_gpu.sh configs/seed0.py runs/seed0
# Holds no hyperparameters: those live in the config file.
#SBATCH --job-name=behaviortrace
#SBATCH --output=slurm-%j.out
set -euo pipefail
: "${SLURM_JOB_ID:?run this script through sbatch/srun}"
: "${SLURM_NTASKS:?SLURM_NTASKS is unset}"
CONFIG=${1:?usage: sbatch launch/slurm_gpu.sh CONFIG WORKDIR [flags...]}
WORKDIR=${2:?usage: sbatch launch/slurm_gpu.sh CONFIG WORKDIR [flags...]}
shift 2
srun --ntasks-per-gpu=1 python3 main.py --multihost --config="$CONFIG" --workdir="$WORKDIR" "$@"
