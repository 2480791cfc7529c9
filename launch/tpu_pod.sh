#!/usr/bin/env bash
# Run main.py on every worker of a Cloud TPU VM pod slice (one process per host).
# Holds no hyperparameters: those live in the config file.
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a REPO_DIR=~/behaviortrace_jax \
#     launch/tpu_pod.sh configs/seed0.py gs://bucket/runs/seed0 [--config.key=value ...]
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME (the TPU VM name)}"
: "${ZONE:?set ZONE (the TPU zone)}"
: "${REPO_DIR:?set REPO_DIR (repo checkout path on every worker)}"
CONFIG=${1:?usage: launch/tpu_pod.sh CONFIG WORKDIR [flags...]}
WORKDIR=${2:?usage: launch/tpu_pod.sh CONFIG WORKDIR [flags...]}
shift 2
EXTRA=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command \
  "cd $REPO_DIR && python3 main.py --multihost --config=$CONFIG --workdir=$WORKDIR$EXTRA 2>&1 | tee -a /tmp/behaviortrace.log"
