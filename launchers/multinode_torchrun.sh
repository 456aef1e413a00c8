#!/usr/bin/env bash
# Several nodes with torchrun and c10d rendezvous: run this same command on every node.
#   NNODES=2 NPROC=8 RDZV_HOST=node-001 launchers/multinode_torchrun.sh configs/gpt2-124m.yaml
# MAX_RESTARTS restarts failed workers (they resume from the newest checkpoint). SIGUSR1 is forwarded to
# the workers like SIGTERM (both mean: finish the step, checkpoint, exit), and the agent waits
# SHUTDOWN_TIMEOUT seconds (> train.preempt_grace_s) before it kills them.
# GLOO_SOCKET_IFNAME names the network interface gloo binds to (export it on every node; it may differ
# per node here), needed where the host name resolves to 127.0.1.1 or another loopback address;
# NCCL_SOCKET_IFNAME defaults to it. torchrun hands the workers this shell's environment.
# torchrun runs inside `python -m zerodp.distributed.launcher` (see launchers/local.sh): each node's command ends with
# the exit code its ranks chose (2: bad input, 130: Ctrl-C, 0: preempted with a checkpoint saved) and
# without torchrun's tracebacks. With restarts left, torchrun restarts the ranks whatever their code, so
# bad input prints its line once per attempt; MAX_RESTARTS=0 while trying a new config.
set -euo pipefail
usage="usage: RDZV_HOST=FIRST_NODE launchers/multinode_torchrun.sh CONFIG.yaml [section.key=value ...]"
if (( $# < 1 )); then echo "multinode_torchrun.sh: error: no config given; $usage" >&2; exit 2; fi
if [ -z "${RDZV_HOST:-}" ]; then
  echo "multinode_torchrun.sh: error: RDZV_HOST is not set; set it to the first node's host name (the same on every node); $usage" >&2
  exit 2
fi
config=$1; shift
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GLOO_SOCKET_IFNAME}; fi
exec python -m zerodp.distributed.launcher --nnodes "${NNODES:-2}" --nproc-per-node "${NPROC:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" \
  --rdzv-id "${RDZV_ID:-zerodp}" --max-restarts "${MAX_RESTARTS:-3}" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-150}" \
  -m zerodp train "$config" "$@"
