#!/usr/bin/env bash
# One machine: all its GPUs, or NPROC CPU processes when it has none.
#   launchers/local.sh configs/tiny.yaml [section.key=value ...]
set -euo pipefail
config=${1:?usage: launchers/local.sh CONFIG.yaml [overrides...]}; shift
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
else
  export DS_ACCELERATOR=cpu          # DeepSpeed on CPU: gloo collectives
  nproc=${NPROC:-2}
fi
exec deepspeed --num_gpus "$nproc" --module zerodp train "$config" "$@"
