#!/usr/bin/env bash
# Several nodes with the deepspeed launcher, run from the first node.
#   launchers/multinode_deepspeed.sh launchers/hostfile.example configs/gpt2-124m.yaml [overrides...]
# LAUNCHER=pdsh (default, passwordless ssh) | openmpi | slurm. MASTER_ADDR defaults to the first host of
# the hostfile. Every node needs the same checkout and environment path.
set -euo pipefail
hostfile=${1:?usage: multinode_deepspeed.sh HOSTFILE CONFIG.yaml [overrides...]}; config=${2:?}; shift 2
launcher=${LAUNCHER:-pdsh}
export MASTER_ADDR=${MASTER_ADDR:-$(grep -v '^#' "$hostfile" | awk 'NF{print $1; exit}')}
export MASTER_PORT=${MASTER_PORT:-29500}
extra=()
# pdsh runs DeepSpeed's per-node launcher, which sets RANK/WORLD_SIZE/MASTER_*; mpirun and srun start
# the ranks directly (zerodp reads OMPI_COMM_WORLD_* / SLURM_*) and must be handed MASTER_* themselves.
[ "$launcher" = openmpi ] && extra=(--launcher_args "-x MASTER_ADDR -x MASTER_PORT")
# The zerodp console script rather than --module: DeepSpeed's slurm runner drops `-m`.
exec deepspeed --hostfile "$hostfile" --launcher "$launcher" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "${extra[@]}" \
  "$(command -v zerodp)" train "$config" "$@"
