#!/usr/bin/env bash
# One machine: one process per GPU a launch here may use, or NPROC CPU processes (2) when it has none.
#   launchers/local.sh configs/tiny.yaml [section.key=value ...]
#   MAX_GPUS=2 launchers/local.sh ...     at most 2 GPUs (make quickstart)
#   NPROC=1 launchers/local.sh ...        exactly 1 process
# The GPUs are counted by `python -m zerodp.distributed.devices count`, the way CUDA counts them: CUDA_VISIBLE_DEVICES
# (indices or GPU-/MIG- UUIDs) applied, a MIG instance one device. torchrun, not the deepspeed launcher,
# starts the processes: `deepspeed --num_gpus N` takes GPUs 0..N-1 whatever CUDA_VISIBLE_DEVICES says, and
# its --include accepts indices only. torchrun leaves CUDA_VISIBLE_DEVICES alone; rank r uses cuda:r of it.
# torchrun runs inside `python -m zerodp.distributed.launcher`, which ends the launch the way zerodp's ranks chose: their
# one line and exit code (2: bad input, 130: Ctrl-C after saving), without torchrun's tracebacks; a rank
# that crashes still shows its traceback, torchrun's failure report and a nonzero code.
# stderr carries only what zerodp and the ranks say; this script's own line goes to stdout.
set -euo pipefail
if (( $# < 1 )); then
  echo "local.sh: error: no config given; usage: launchers/local.sh CONFIG.yaml [section.key=value ...]" >&2
  exit 2
fi
config=$1; shift
if [[ -n ${NPROC:-} && ! $NPROC =~ ^[1-9][0-9]*$ ]]; then
  echo "local.sh: error: NPROC=$NPROC is not a number of processes; set NPROC=1, 2, ... or unset it" >&2
  exit 2
fi
if [[ -n ${NPROC:-} ]]; then
  gpus=$(python -m zerodp.distributed.devices count)
else
  gpus=$(python -m zerodp.distributed.devices count ${MAX_GPUS:+--max "$MAX_GPUS"})
fi
if (( gpus > 0 )); then
  nproc=${NPROC:-$gpus}
  if (( nproc > gpus )); then
    echo "local.sh: error: NPROC=$nproc but this machine offers $gpus GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); set NPROC to at most $gpus, or CUDA_VISIBLE_DEVICES= for CPU processes" >&2
    exit 2
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's own choice, without its banner saying so
else
  export DS_ACCELERATOR=cpu          # DeepSpeed on CPU: gloo collectives
  nproc=${NPROC:-2}
  cores=$(getconf _NPROCESSORS_ONLN)  # the cores shared out (torchrun would leave each process 1 thread)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 1 ? cores / nproc : 1 ))}
fi
echo "local.sh: $nproc process(es) on $( (( gpus > 0 )) && echo "$nproc GPU(s)" || echo "the CPU")"
# After a Ctrl-C (or SIGTERM) the ranks train on to the next log step and save; torchrun kills them after
# --shutdown-timeout seconds (30 unless set), so it waits longer than train.preempt_grace_s (120 s).
exec python -m zerodp.distributed.launcher --standalone --nproc-per-node "$nproc" --shutdown-timeout 150 \
  -m zerodp train "$config" "$@"
