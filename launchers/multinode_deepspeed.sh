#!/usr/bin/env bash
# Several nodes with the deepspeed launcher, run from the first node.
#   GLOO_SOCKET_IFNAME=eth0 launchers/multinode_deepspeed.sh launchers/hostfile.example configs/gpt2-124m.yaml [overrides...]
# LAUNCHER=pdsh (default, passwordless ssh) | openmpi | slurm. MASTER_ADDR defaults to the first host of
# the hostfile. Every node needs the same checkout and environment path.
# GLOO_SOCKET_IFNAME names the network interface (the same name on every node) that gloo binds to;
# needed when a node's host name resolves to 127.0.1.1 or another loopback address (zerodp stops with
# an error naming the variable). NCCL_SOCKET_IFNAME defaults to it. Both reach every rank.
# A rank's bad input reaches this shell as its one line and exit code 2 (DeepSpeed's runner passes a
# failed rank's code on, and logs only on stdout); after a Ctrl-C the runner exits with 1 whatever the
# ranks did, and this script with 130, as zerodp's ranks do.
set -euo pipefail
usage="usage: launchers/multinode_deepspeed.sh HOSTFILE CONFIG.yaml [section.key=value ...]"
if (( $# < 2 )); then echo "multinode_deepspeed.sh: error: a hostfile and a config are needed; $usage" >&2; exit 2; fi
hostfile=$1; config=$2; shift 2
if [ ! -f "$hostfile" ]; then
  echo "multinode_deepspeed.sh: error: hostfile $hostfile not found; one line per node, e.g. launchers/hostfile.example; $usage" >&2
  exit 2
fi
zerodp=$(command -v zerodp) || {
  echo "multinode_deepspeed.sh: error: the zerodp command is not on PATH; activate the environment zerodp is installed in" >&2
  exit 2
}
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
# A Ctrl-C reaches the runner too. The interpreter this script becomes only notes it (a Python handler:
# a bash trap around the foreground runner missed it now and then), waits for the runner and then says
# 130. close_fds=False: the runner reads DS_ENV_FILE from this process's fd 3.
python=$(command -v python3 || command -v python) || {
  echo "multinode_deepspeed.sh: error: no python3 on PATH; activate the environment zerodp is installed in" >&2
  exit 2
}
# The zerodp console script rather than --module: DeepSpeed's slurm runner drops `-m`.
exec "$python" -c '
import signal, subprocess, sys
interrupted = []
signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
rc = subprocess.call(sys.argv[1:], close_fds=False)
sys.exit(130 if interrupted else rc if rc >= 0 else 128 - rc)' \
  deepspeed --hostfile "$hostfile" --launcher "$launcher" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "${extra[@]}" \
  "$zerodp" train "$config" "$@"
