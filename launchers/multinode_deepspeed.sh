#!/usr/bin/env bash
# Several nodes with the deepspeed launcher, run from the first node.
#   launchers/multinode_deepspeed.sh launchers/hostfile.example configs/gpt2-124m.yaml [overrides...]
# LAUNCHER=pdsh (default) | openmpi | slurm ; MASTER_ADDR defaults to the first host of the hostfile.
set -euo pipefail
hostfile=${1:?usage: multinode_deepspeed.sh HOSTFILE CONFIG.yaml [overrides...]}; config=${2:?}; shift 2
master=${MASTER_ADDR:-$(grep -v '^#' "$hostfile" | awk 'NF{print $1; exit}')}
exec deepspeed --hostfile "$hostfile" --launcher "${LAUNCHER:-pdsh}" \
  --master_addr "$master" --master_port "${MASTER_PORT:-29500}" \
  --module zerodp train "$config" "$@"
