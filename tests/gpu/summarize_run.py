"""Summarise a training run's metrics.jsonl: median seconds per phase, memory, agreement.

    python tests/gpu/summarize_run.py runs/grpo-embedded [--skip 1]

Prints one JSON line: the median of every seconds metric (*_s, not the *_per_s rates) over the steps
after --skip (the first step pays for start-up: CUDA graphs, allocator, NCCL communicators), the max
of every mem_* metric, the mean logprob_mismatch, and the mean reward of the first and last 5 steps.
Plus the split of a step: overhead_s, the median over steps of what is neither generation nor the
trainer's compute (sync, sleep, wake, offload, reload, reward), and overhead_share = overhead_s /
step_s (the target is <= 0.10); generation and gathers of samples stay in rollout_s, the trainer's
passes in old_logprob_s, ref_s and train_s.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common.run.plots import is_seconds  # noqa: E402  (seconds, not a rate such as gen_tokens_per_s)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="--out of the training run (holds metrics.jsonl)")
    ap.add_argument("--skip", type=int, default=1, help="leading steps left out of the medians")
    args = ap.parse_args()
    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    timed = rows[args.skip :] or rows
    keys = sorted({k for r in rows for k in r})
    out = {"steps": len(rows)}
    out.update({k: round(statistics.median(r[k] for r in timed if k in r), 4) for k in keys if is_seconds(k)})
    out.update({k: round(max(r[k] for r in rows if k in r), 2) for k in keys if k.startswith("mem_")})
    for k in ("logprob_mismatch", "value_loss", "explained_variance"):
        if k in keys:
            out[k] = round(statistics.mean(r[k] for r in timed if k in r), 4)
    rewards = [r["reward_mean"] for r in rows]
    out["reward_first5"], out["reward_last5"] = (
        round(statistics.mean(rewards[:5]), 4),
        round(statistics.mean(rewards[-5:]), 4),
    )
    overheads = ("sync_s", "sleep_s", "wake_s", "offload_s", "reload_s", "reward_s")
    per_step = [sum(r.get(k, 0.0) for k in overheads) for r in timed]
    out["overhead_s"] = round(statistics.median(per_step), 4)
    out["overhead_share"] = round(statistics.median(o / r["step_s"] for o, r in zip(per_step, timed)), 4)
    print(json.dumps(out))
