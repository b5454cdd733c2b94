"""Logging of training metrics: metrics.jsonl (the source of truth), wandb, and a PNG of curves;
the run record (config.json). The console (known-harmless warnings, third-party logging, the progress
bar): common/run/console.py.

    logger = MetricsLogger(out_dir, run_record(vars(args), layout), wandb_mode=args.wandb_mode,
                           project="mcore-rl", run_name=args.run_name, enabled=master_process)
    logger.log(step, {"reward_mean": r, "kl": kl, "rollout_s": t_rollout, ...})
    logger.close()

Only global rank 0 writes (the caller passes enabled=master_process); on the other ranks every
method is a no-op. `print0` lives in common/run/dist.py and is re-exported here for convenience.

Files in out_dir: metrics.jsonl (one line per step), metrics.replaced.jsonl (the lines a resume
replaced, kept), config.json (run_record), curves.png, wandb_run_id.

Naming convention the plot relies on (common/run/plots.py draws curves.png): keys ending in `_s`
are seconds spent in one phase of the step (rollout_s, sync_s, train_s, ...) and are stacked;
`step_s` is the whole step, drawn as a line over the stack; throughputs end in `_per_s`
(gen_tokens_per_s) and get a panel of their own.
"""

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import datetime

from common.run.dist import print0  # noqa: F401  (re-export: `from common.log import print0`)

REPLACED_FILE = "metrics.replaced.jsonl"


# ---- run record (config.json) ------------------------------------------------------------

# Distributions whose versions explain a difference between two runs. Read from package
# metadata, not by importing: importing vllm takes seconds and initialises CUDA state.
VERSIONED_PACKAGES = ("torch", "megatron-core", "transformers", "vllm", "numpy", "wandb")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_state(repo_dir=REPO_ROOT):
    """{"commit": sha, "dirty": bool} of the checkout the code runs from, or None when it is not
    a git checkout or git is missing (a pip-installed copy, a container without git).
    dirty = tracked files differ from the commit; untracked files (runs/, data) do not count."""

    def git(*cmd):
        return subprocess.run(
            ["git", "-C", repo_dir, *cmd], capture_output=True, text=True, check=True, timeout=30
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):  # no git binary, not a repo, git too slow
        return None
    return {"commit": commit, "dirty": dirty}


def package_versions(names=VERSIONED_PACKAGES):
    """{"python": ..., name: version or None when not installed} from importlib.metadata."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def run_record(args: dict, layout: dict) -> dict:
    """What config.json holds, enough to reproduce or explain a run: the resolved arguments
    (vars(args) after parse_args filled the defaults, with what the scripts resolve later: the
    dtype and engine used, ...), the command line as given (argv), the code's git commit, the
    library versions, the host, the start time and the parallel layout (world size, tp, pp, dp, ...).

    Plain JSON types only (values json cannot hold become strings), so the record reads back
    equal to what was written."""
    record = {
        "args": args,
        "argv": sys.argv,  # the command line as given (args: as resolved)
        "git": git_state(),
        "versions": package_versions(),
        "hostname": socket.gethostname(),
        "start_time": datetime.now().astimezone().isoformat(timespec="seconds"),
        "layout": layout,
    }
    return json.loads(json.dumps(record, default=str))


def _move_aside(path):
    """Rename path to path.old-<timestamp> (a free name) and return the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = f"{path}.old-{stamp}", 1
    while os.path.exists(target):  # two moves in the same second
        target, n = f"{path}.old-{stamp}-{n}", n + 1
    os.replace(path, target)
    return target


def default_wandb_mode():
    """ "online" when wandb credentials exist (wandb_credentials), else "disabled".

    An explicit WANDB_MODE environment variable (online/offline/disabled) wins.
    """
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("online", "offline", "disabled"):
        return mode
    return "online" if wandb_credentials() else "disabled"


def wandb_credentials():
    """Where wandb would find an API key for its server, as wandb 0.31 looks (environment, a netrc
    entry for the host of WANDB_BASE_URL, the api_key of its settings file), or None. Reads files
    only: no network call, no wandb import."""
    import configparser
    import netrc
    from urllib.parse import urlsplit

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(name):
            return name
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    home = os.path.expanduser("~")
    netrc_path = os.environ.get("NETRC") or next(
        (p for p in (os.path.join(home, ".netrc"), os.path.join(home, "_netrc")) if os.path.isfile(p)), None
    )
    try:
        if netrc_path and host and (netrc.netrc(netrc_path).authenticators(host) or (None,) * 3)[2]:
            return netrc_path  # written by `wandb login`
    except (OSError, netrc.NetrcParseError):
        pass
    settings = os.path.join(os.environ.get("WANDB_CONFIG_DIR") or os.path.join(home, ".config", "wandb"), "settings")
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
    except configparser.Error:
        return None
    return settings if parser.get("default", "api_key", fallback=None) else None


def _to_number(value):
    """One-element tensors / numpy scalars -> python numbers (json can't serialise them)."""
    if hasattr(value, "item"):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return float(value)


class MetricsLogger:
    def __init__(
        self,
        out_dir,
        config: dict,
        wandb_mode: str = "disabled",
        project: str = "mcore-rl",
        run_name: str | None = None,
        enabled: bool = True,
        plot_every: int = 10,
        resume: bool = False,
        overwrite: bool = False,
    ):
        """config: what config.json holds (run_record(...)); it also goes to wandb.

        resume=True appends to out_dir's metrics.jsonl (and continues its wandb run); then call
        truncate_after(resume_step) to set aside the steps that will be redone.
        resume=False starts a new run and never destroys an earlier one: a non-empty
        metrics.jsonl raises FileExistsError, unless overwrite=True, which renames it (and the
        old config.json) to *.old-<timestamp> first. The scripts refuse a used --out before
        this; this is the last line of defence.

        A resumed run's previous config.json is kept as config.json.old-<timestamp>."""
        assert wandb_mode in ("online", "offline", "disabled"), wandb_mode
        self.enabled, self.plot_every = enabled, plot_every
        self.out_dir = str(out_dir)
        self.path = os.path.join(self.out_dir, "metrics.jsonl")
        self.history = []  # list of {"step": ..., **metrics}: what the plot is drawn from
        self.wandb_run = None
        if not enabled:
            return
        config_path = os.path.join(self.out_dir, "config.json")
        has_metrics = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if has_metrics and not resume:
            if not overwrite:
                raise FileExistsError(
                    f"{self.path} already holds the metrics of an earlier run; refusing to start a "
                    "new run over it. Resume that run (resume=True, --resume), choose another output "
                    "directory, or pass overwrite=True to move the old file aside."
                )
            _move_aside(self.path)
        if os.path.exists(config_path) and (resume or has_metrics):
            _move_aside(config_path)  # the earlier start's record, kept next to the new one
        os.makedirs(self.out_dir, exist_ok=True)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, default=str)
        # A resumed run appends to the existing file; keep its lines so the plot covers them.
        if resume and os.path.exists(self.path):
            with open(self.path) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
        # "a" in both cases: a fresh run's file is absent or empty here (checked above)
        self.file = open(self.path, "a")
        if wandb_mode != "disabled":
            import wandb  # lazy: a disabled run never imports it (slow import, spawns a service)

            # Reuse the run id across resumes so the curves continue in the same wandb run.
            id_path = os.path.join(self.out_dir, "wandb_run_id")
            run_id = open(id_path).read().strip() if resume and os.path.exists(id_path) else None
            self.wandb_run = wandb.init(
                project=project,
                name=run_name,
                config=config,
                mode=wandb_mode,
                dir=self.out_dir,
                id=run_id,
                resume="allow" if run_id else None,
            )
            with open(id_path, "w") as f:
                f.write(self.wandb_run.id)

    def log(self, step: int, metrics: dict):
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _to_number(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crash or a preempted job keeps every step logged so far
        self.history.append(record)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        if self.plot_every and (step + 1) % self.plot_every == 0:
            self.plot()

    def truncate_after(self, step: int):
        """Keep in metrics.jsonl only lines with step < `step` (call on resume from checkpoint
        `step`: the steps from there on are redone and logged again).

        Nothing logged is lost: the lines removed are appended to metrics.replaced.jsonl in
        out_dir, each as {"replaced_by_resume_at": step, **original line}, in their original
        order. (They differ from the redone steps when the run was not bit-exact, or when it
        ran past its last checkpoint before it stopped.)"""
        if not self.enabled:
            return
        dropped = [r for r in self.history if r["step"] >= step]
        if not dropped:
            return
        # The side file first: a crash between the two writes duplicates lines, never loses them.
        with open(os.path.join(self.out_dir, REPLACED_FILE), "a") as f:
            f.writelines(json.dumps({"replaced_by_resume_at": int(step), **r}) + "\n" for r in dropped)
            f.flush()
            os.fsync(f.fileno())
        self.history = [r for r in self.history if r["step"] < step]
        self.file.close()
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.history)
        os.replace(tmp, self.path)  # readers see the old or the new file, never half of one
        self.file = open(self.path, "a")

    def plot(self):
        """Redraw out_dir/curves.png from the steps logged so far (common/run/plots.py).
        Returns the matplotlib Figure (None when there is nothing to draw)."""
        if not self.enabled or not self.history:
            return None
        from common.run.plots import plot_curves

        return plot_curves(self.history, os.path.join(self.out_dir, "curves.png"))

    def log_samples(self, step, tokenizer, samples, rewards, *, every, stride, count=3, width=300):
        """Every `every` steps (0: never): `count` samples, one per prompt group (`stride` apart),
        decoded: printed (rank 0, above the progress bar, prompt and response cut to `width`
        characters), appended whole to samples.jsonl, and to wandb as a table."""
        if not self.enabled or not every or step % every:
            return
        from tqdm import tqdm

        rows = []
        for i in range(0, len(samples), stride)[:count]:
            prompt = tokenizer.decode(samples[i].prompt_ids)
            response = tokenizer.decode(samples[i].response_ids, skip_special_tokens=True)
            rows.append({"step": int(step), "prompt": prompt, "response": response, "reward": float(rewards[i])})

        def cut(text, tail=False):  # one line; the end of a prompt (the question), the start of a response
            text = text.replace("\n", " | ")
            return text if len(text) <= width else ("..." + text[-width:] if tail else text[:width] + "...")

        for row in rows:
            tqdm.write(
                f"[step {step}] reward {row['reward']:.3f} | prompt: {cut(row['prompt'], tail=True)}\n"
                f"    response: {cut(row['response'])}"
            )
        with open(os.path.join(self.out_dir, "samples.jsonl"), "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log(
                {"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=int(step)
            )

    def close(self):
        if not self.enabled:
            return
        self.plot()
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
