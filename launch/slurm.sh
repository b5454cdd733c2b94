#!/bin/bash
# Multi-node launch: one `torchrun` per node via srun; torchrun starts one rank per GPU.
# Every argument is forwarded unchanged, so a cluster run takes the same flags as a local one:
#
#   sbatch launch/slurm.sh train_grpo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4
#
# Two nodes x 8 GPUs = 16 ranks (e.g. TP=4 x DP=4). Override the defaults on the command line:
#
#   sbatch --nodes 4 --partition gpu --time 12:00:00 launch/slurm.sh train_grpo.py --model ... --tp 8
#
# Optional environment (export before sbatch; sbatch passes the environment through):
#   VENV=/path/to/.venv          activate this virtualenv on every node
#   CONTAINER_IMAGE=img.sqsh     run inside a container (pyxis/enroot: srun --container-image)
#   CONTAINER_MOUNTS=/data:/data extra mounts for the container (the submit dir is always mounted)
#   GPUS_PER_NODE=8              ranks per node (defaults to the GPUs Slurm gave each node)
#   MASTER_PORT=29500            rendezvous port on the first node
#   STOP_GRACE_S=280             how long the ranks get to finish their step and save after the
#                                stop signal (keep it below --signal's lead time)
#
# Time limits and preemption: 300 s before the time limit Slurm sends SIGUSR1 to this script
# (--signal=B:USR1@300); it is passed to the ranks (through srun and torchrun), which finish
# the current step, save a checkpoint and exit; then the job requeues itself. A preempted job
# (SIGTERM from Slurm) saves the same way and is requeued by Slurm. A requeued job runs the
# same command with `--resume auto` added: it continues from the newest checkpoint in --out.
# Choose the lead time above one step plus one checkpoint save.
#
#SBATCH --job-name=mcore-rl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

# A mistake in how this file is called: one line that says what to do instead, exit 2 (as the
# scripts' own argument errors), before srun starts anything.
fail() {
    echo "launch/slurm.sh: error: $*" >&2
    exit 2
}
USAGE="sbatch [--nodes N ...] launch/slurm.sh SCRIPT.py [flags...], e.g. sbatch launch/slurm.sh train_grpo.py --tp 4"
if [ "$#" -eq 0 ]; then
    fail "no script given: $USAGE"
fi
case "$1" in
    -*) fail "the first argument is the script to run, not $1 (sbatch's options go before launch/slurm.sh): $USAGE" ;;
esac
if [ -z "${SLURM_JOB_NODELIST:-}" ] || [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_NNODES:-}" ]; then
    fail "not inside a Slurm job (no SLURM_JOB_NODELIST): submit it, $USAGE; here: bash launch/local.sh $1 ..."
fi
if [ ! -f "$1" ]; then
    fail "no such script: $1 (from $PWD, where the job runs: submit from the repository root): $USAGE"
fi
if [ -n "${GPUS_PER_NODE:-}" ] && ! [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    fail "GPUS_PER_NODE must be a number of ranks per node >= 1, not '$GPUS_PER_NODE'"
fi
if [ -n "${VENV:-}" ] && [ ! -f "$VENV/bin/activate" ]; then
    fail "VENV=$VENV has no bin/activate: point VENV at a virtualenv directory (e.g. VENV=\$PWD/.venv)"
fi

# Rendezvous on the first node of the allocation (torchrun's c10d store runs there).
# (Read all hostnames, not `| head -n 1`: with pipefail, head closing the pipe early can
# kill scontrol with SIGPIPE and fail the job at random.)
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${HOSTS[0]}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MASTER_ADDR MASTER_PORT

# One OpenMP thread per rank: 8 ranks x all cores each would oversubscribe the CPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Keep the NCCL errors visible instead of hanging until the watchdog timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# torchrun forwards these signals to the ranks (SIGUSR1 is not among its defaults) and waits
# this long for them to exit before it kills them.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-280}

if [ -n "${VENV:-}" ]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi

SRUN_ARGS=(--nodes "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1)
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    MOUNTS="$PWD:$PWD${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
    SRUN_ARGS+=(--container-image "$CONTAINER_IMAGE" --container-mounts "$MOUNTS" --container-workdir "$PWD")
fi

ARGS=("$@")
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then  # requeued: continue where the last attempt saved
    ARGS+=(--resume auto)
fi
echo "job $SLURM_JOB_ID (attempt $((${SLURM_RESTART_COUNT:-0} + 1))): $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT"
echo "command: ${ARGS[*]}"

# torchrun through launch/torchrun.py (beside the training script: the repository), which adds
# last words when a rank dies: which one, the signal or exit code, the likely cause, the last
# complete checkpoint. A script elsewhere gets plain torchrun.
TORCHRUN=(torchrun)
if [ -f "$(dirname "$1")/launch/torchrun.py" ]; then
    TORCHRUN=(python "$(dirname "$1")/launch/torchrun.py")
fi
srun "${SRUN_ARGS[@]}" "${TORCHRUN[@]}" \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv_id "$SLURM_JOB_ID" \
    "${ARGS[@]}" &
SRUN_PID=$!
REQUEUE=0
# The time limit is near: pass the signal on (srun forwards it to torchrun, torchrun to the
# ranks), let them save, then put the job back in the queue.
trap 'echo "time limit near: the ranks finish their step, save and exit; then the job requeues"; REQUEUE=1; kill -USR1 "$SRUN_PID"' USR1
set +e
wait "$SRUN_PID"; RC=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; RC=$?; done  # a trap interrupts wait
set -e
if [ "$REQUEUE" = 1 ]; then
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if [ "$RC" != 0 ]; then  # the node whose rank died said which and why above (a node lost says nothing)
    echo "job $SLURM_JOB_ID: the ranks stopped (srun exit code $RC); see the [launch] lines above, or srun's" \
        "errors for a node that was lost" >&2
fi
exit "$RC"
