"""What the GPU tests that launch a training script share: the launch (plain python, or torchrun on
`ranks` GPUs), its exit 0, the metrics.jsonl it wrote, and a results file under $OUT.

    rows, output = run_script("train_grpo.py", out, "--model", model, *flags, ranks=2, timeout=500)
    save_results("lora.json", results)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script, out, *flags, ranks=None, timeout=400):
    """(rows of <out>/metrics.jsonl, stdout + stderr) of `script flags --out out`, run from the repository
    root with wandb off; ranks: under torchrun --standalone with that many processes (None: plain python).
    A non-zero exit fails the test with the output's tail."""
    launch = [sys.executable]
    if ranks is not None:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    proc = subprocess.run(
        [*launch, script, *map(str, flags), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return rows, output


def kept(rows, keys):
    """Each row's values of `keys` (those it has)."""
    return [{k: r[k] for k in keys if k in r} for r in rows]


def save_results(name, results):
    """$OUT/name as JSON (run_all.sh collects $OUT), when $OUT is set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(results, f, indent=1)
