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

if [ "$#" -eq 0 ]; then
    echo "usage: [NPROC=N] bash launch/local.sh SCRIPT.py [flags...]" >&2
    exit 2
fi

NPROC=${NPROC:-1}
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
if [ "$NPROC" -eq 1 ]; then
    exec "$PY" "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun through the same python (not the first `torchrun` on PATH, which may belong to
# another environment). --standalone: single-node rendezvous on a free local port.
# launch/torchrun.py is torchrun plus last words when a rank dies (which one, the signal or
# exit code, the likely cause, the last complete checkpoint).
exec "$PY" "$ROOT/launch/torchrun.py" --standalone --nproc_per_node "$NPROC" "$@"
