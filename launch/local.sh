#!/bin/bash
# Local launches (one machine). The same script flags work under launch/slurm.sh.
#
#   # 1 CPU, nothing to download: embedded tiny model + synthetic task
#   python train_grpo.py
#
#   # 1 GPU (a small model fits with TP=1)
#   python train_grpo.py --model /models/Qwen2-0.5B-Instruct --data gsm8k.parquet
#
#   # 8 GPUs on one node: TP=4 x DP=2, one vLLM worker colocated on each GPU
#   torchrun --nproc_per_node 8 train_grpo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4
#
#   # 2 CPU ranks on gloo (what the multi-rank tests do)
#   torchrun --nproc_per_node 2 train_grpo.py --tp 2
#
# This file also runs them: NPROC ranks (default 1 = plain python), arguments forwarded:
#
#   bash launch/local.sh train_grpo.py
#   NPROC=8 bash launch/local.sh train_grpo.py --model /models/Qwen2-7B --tp 4
#
# The python it runs (torchrun too, as `python launch/torchrun.py`): $PYTHON if set, else
# the repository's .venv/bin/python when it exists, else python3 from PATH.
set -euo pipefail

# A mistake in how this file is called: one line that says what to do instead, exit 2 (as the
# scripts' own argument errors), before python or torchrun start.
fail() {
    echo "launch/local.sh: error: $*" >&2
    exit 2
}
USAGE="[NPROC=N] bash launch/local.sh SCRIPT.py [flags...], e.g. NPROC=2 bash launch/local.sh train_grpo.py --tp 2"
if [ "$#" -eq 0 ]; then
    fail "no script given: $USAGE"
fi
case "$1" in
    -*) fail "the first argument is the script to run, not the flag $1: $USAGE" ;;
esac
if [ ! -f "$1" ]; then
    fail "no such script: $1 (from $PWD; run from the repository root, or give its path): $USAGE"
fi
NPROC=${NPROC:-1}
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    fail "NPROC must be a number of ranks >= 1, not '$NPROC': $USAGE"
fi
# The repo's own environment first: a `python` on PATH may be another one without megatron-core
# (or none at all: Debian/Ubuntu ship only python3).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    fail "no python '$PY': set PYTHON=/path/to/python, or create the repository's .venv (make venv)"
fi
if [ "$NPROC" -eq 1 ]; then
    exec "$PY" "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Stopping (Ctrl-C, SIGTERM, the terminal closing): the ranks finish their step and save a
# checkpoint, minutes for a large model, but torchrun SIGKILLs them 30 s after it forwards a signal
# (fixed before torch 2.12). So torchrun runs in a process group of its own, which the terminal's
# Ctrl-C does not reach, and this script hands the signal to the ranks itself: they save and exit 0,
# and so does torchrun. A second Ctrl-C aborts. Should torchrun itself be signalled, torch >= 2.12
# gives the ranks STOP_GRACE_S seconds.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-900}
# torchrun through the same python (not the first `torchrun` on PATH, which may belong to
# another environment). --standalone: single-node rendezvous on a free local port.
# launch/torchrun.py is torchrun plus last words when a rank dies (which one, the signal or
# exit code, the likely cause, the last complete checkpoint).
set -m  # job control: the background job gets its own process group
"$PY" "$ROOT/launch/torchrun.py" --standalone --nproc_per_node "$NPROC" "$@" &
TORCHRUN=$!
set +m
to_ranks() { pkill "-$1" -P "$TORCHRUN" || kill "-$1" "$TORCHRUN" 2>/dev/null || true; }
trap 'to_ranks INT' INT
trap 'to_ranks TERM' TERM HUP
set +e
wait "$TORCHRUN"; RC=$?
while kill -0 "$TORCHRUN" 2>/dev/null; do wait "$TORCHRUN"; RC=$?; done  # a trapped signal interrupts wait
exit "$RC"
