#!/usr/bin/env bash
# Several nodes with the deepspeed launcher, run from the first node.
#   GLOO_SOCKET_IFNAME=eth0 launchers/multinode_deepspeed.sh launchers/hostfile.example configs/gpt2-124m.yaml [overrides...]
# LAUNCHER=pdsh (default, passwordless ssh) | openmpi | slurm. MASTER_ADDR defaults to the first host of
# the hostfile. Every node needs the same checkout and environment path.
# GLOO_SOCKET_IFNAME names the network interface (the same name on every node) that gloo binds to;
# needed when a node's host name resolves to 127.0.1.1 or another loopback address (zerodp stops with
# an error naming the variable). NCCL_SOCKET_IFNAME defaults to it. Both reach every rank.
set -euo pipefail
hostfile=${1:?usage: multinode_deepspeed.sh HOSTFILE CONFIG.yaml [overrides...]}; config=${2:?}; shift 2
launcher=${LAUNCHER:-pdsh}
export MASTER_ADDR=${MASTER_ADDR:-$(grep -v '^#' "$hostfile" | awk 'NF{print $1; exit}')}
export MASTER_PORT=${MASTER_PORT:-29500}
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GLOO_SOCKET_IFNAME}; fi
# DeepSpeed's runners hand the ranks only variables named NCCL* (on CUDA), PYTHON*, UCX*, MV2*, MLFLOW*,
# plus the KEY=VALUE lines of ~/.deepspeed_env and ./.deepspeed_env (file name: $DS_ENV_FILE): never
# GLOO_*. So the interface variables go into an env file made of those files' lines and then ours,
# which DS_ENV_FILE names. It is deleted at once and read through this process's descriptor 3, which
# the runner inherits: nothing is left behind and the user's files are not touched.
if [ -n "${GLOO_SOCKET_IFNAME:-}${NCCL_SOCKET_IFNAME:-}" ]; then
  name=${DS_ENV_FILE:-.deepspeed_env}
  case $name in /*) sources=("$name") ;; *) sources=("$HOME/$name" "./$name") ;; esac
  env_file=$(mktemp)
  for f in "${sources[@]}"; do
    if [ -f "$f" ]; then grep -v '^[[:space:]]*$' "$f" >>"$env_file" || true; fi  # a blank line stops DeepSpeed
  done
  for v in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
    if [ -n "${!v:-}" ]; then echo "$v=${!v}" >>"$env_file"; fi
  done
  exec 3<"$env_file"; rm -f "$env_file"
  export DS_ENV_FILE=/proc/self/fd/3
fi
extra=()
# pdsh runs DeepSpeed's per-node launcher, which sets RANK/WORLD_SIZE/MASTER_*; mpirun and srun start
# the ranks directly (zerodp reads OMPI_COMM_WORLD_* / SLURM_*) and must be handed MASTER_* themselves.
[ "$launcher" = openmpi ] && extra=(--launcher_args "-x MASTER_ADDR -x MASTER_PORT")
# The zerodp console script rather than --module: DeepSpeed's slurm runner drops `-m`.
exec deepspeed --hostfile "$hostfile" --launcher "$launcher" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "${extra[@]}" \
  "$(command -v zerodp)" train "$config" "$@"
