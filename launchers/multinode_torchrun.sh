#!/usr/bin/env bash
# Several nodes with torchrun and c10d rendezvous: run this same command on every node.
#   NNODES=2 NPROC=8 RDZV_HOST=node-001 launchers/multinode_torchrun.sh configs/gpt2-124m.yaml
# MAX_RESTARTS restarts failed workers (they resume from the newest checkpoint). SIGUSR1 is forwarded to
# the workers like SIGTERM (both mean: finish the step, checkpoint, exit), and the agent waits
# SHUTDOWN_TIMEOUT seconds (> train.preempt_grace_s) before it kills them.
# GLOO_SOCKET_IFNAME names the network interface gloo binds to (export it on every node; it may differ
# per node here), needed where the host name resolves to 127.0.1.1 or another loopback address;
# NCCL_SOCKET_IFNAME defaults to it. torchrun hands the workers this shell's environment.
set -euo pipefail
config=${1:?usage: multinode_torchrun.sh CONFIG.yaml [overrides...]}; shift
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GLOO_SOCKET_IFNAME}; fi
exec torchrun --nnodes "${NNODES:-2}" --nproc-per-node "${NPROC:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "${RDZV_HOST:?set RDZV_HOST to the first node}:${RDZV_PORT:-29400}" \
  --rdzv-id "${RDZV_ID:-zerodp}" --max-restarts "${MAX_RESTARTS:-3}" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-150}" \
  -m zerodp train "$config" "$@"
