"""Tests of common/run/log.py and common/run/console.py: metrics.jsonl content, curves.png written (its panels:
test_plots.py), wandb offline, resume (truncate keeps the replaced lines, a fresh run never destroys one), the run
record, and the warning filters.

    .venv/bin/python -m pytest -q tests/test_log.py
"""

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from common.run.console import quiet_known_warnings, quiet_third_party_logging
from common.run.log import MetricsLogger, default_wandb_mode, run_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_config_and_plot(tmp_path):
    logger = MetricsLogger(
        tmp_path,
        {"lr": 1e-6, "model": "tiny"},
        wandb_mode="disabled",
        project="p",
        run_name=None,
        enabled=True,
        plot_every=2,
    )
    assert json.load(open(tmp_path / "config.json")) == {"lr": 1e-6, "model": "tiny"}
    logger.log(
        0,
        {
            "reward_mean": torch.tensor(0.25),
            "kl": np.float32(0.5),
            "n": torch.tensor(3),
            "rollout_s": 1.5,
            "train_s": 0.5,
            "tag": "x",
        },
    )
    # flushed line by line: readable before close, and no plot yet (plot_every=2)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 0, "reward_mean": 0.25, "kl": 0.5, "n": 3, "rollout_s": 1.5, "train_s": 0.5, "tag": "x"}
    ]
    assert not (tmp_path / "curves.png").exists()
    logger.log(
        1,
        {"reward_mean": 0.75, "grad_norm": torch.tensor(2.0, dtype=torch.bfloat16), "rollout_s": 1.0, "train_s": 0.25},
    )
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == json.dumps({"step": 1, "reward_mean": 0.75, "grad_norm": 2.0, "rollout_s": 1.0, "train_s": 0.25})
    assert not (tmp_path / "wandb").exists()


def test_log_samples(tmp_path, capsys):
    """Every `every` steps: one sample per prompt group (stride apart), decoded, printed on one
    line each (prompt cut at its start, response at its end) and kept whole in samples.jsonl."""
    import types

    from transformers import AutoTokenizer

    from common.run.embedded import write_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(write_embedded_model(str(tmp_path / "model")))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    samples = [
        types.SimpleNamespace(prompt_ids=encode(f"question {i}\nsay {i}="), response_ids=encode(f"{i}" * (1 + 40 * i)))
        for i in range(4)
    ]
    logger = MetricsLogger(tmp_path / "out", {}, wandb_mode="disabled")
    logger.log_samples(3, tokenizer, samples, [0.0, 0.5, 1.0, 0.25], every=2, stride=2)  # 3 % 2: not this step
    assert not (tmp_path / "out" / "samples.jsonl").exists() and capsys.readouterr().out == ""
    logger.log_samples(4, tokenizer, samples, [0.0, 0.5, 1.0, 0.25], every=2, stride=2, width=12)
    assert read_jsonl(tmp_path / "out" / "samples.jsonl") == [
        {"step": 4, "prompt": "question 0\nsay 0=", "response": "0", "reward": 0.0},
        {"step": 4, "prompt": "question 2\nsay 2=", "response": "2" * 81, "reward": 1.0},
    ]
    assert capsys.readouterr().out.splitlines() == [
        "[step 4] reward 0.000 | prompt: ...n 0 | say 0=",
        "    response: 0",
        "[step 4] reward 1.000 | prompt: ...n 2 | say 2=",
        "    response: " + "2" * 12 + "...",
    ]
    logger.close()


def test_disabled_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "out", {"a": 1}, wandb_mode="offline", project="p", run_name=None, enabled=False)
    logger.log(0, {"reward_mean": 1.0})
    logger.truncate_after(0)
    logger.close()
    assert not (tmp_path / "out").exists()


def test_truncate_after_resume(tmp_path):
    logger = MetricsLogger(tmp_path, {"start": 1}, enabled=True, plot_every=0)
    for step in range(5):
        logger.log(step, {"reward_mean": step / 10})
    logger.close()
    # resume from a checkpoint at step 3: steps 3, 4 are redone
    logger = MetricsLogger(tmp_path, {"start": 2}, enabled=True, plot_every=0, resume=True)
    logger.truncate_after(3)
    # config.json is the resumed start's record; the first start's is kept beside it
    assert json.load(open(tmp_path / "config.json")) == {"start": 2}
    (old_config,) = [n for n in os.listdir(tmp_path) if n.startswith("config.json.old-")]
    assert json.load(open(tmp_path / old_config)) == {"start": 1}
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    logger.log(3, {"reward_mean": 0.9})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 0, "reward_mean": 0.0},
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "reward_mean": 0.2},
        {"step": 3, "reward_mean": 0.9},
    ]
    assert [r["step"] for r in logger.history] == [0, 1, 2, 3]  # the plot covers the resumed part
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_MAGIC)  # close() draws
    # the lines the resume replaced are kept, tagged, in their order
    assert read_jsonl(tmp_path / "metrics.replaced.jsonl") == [
        {"replaced_by_resume_at": 3, "step": 3, "reward_mean": 0.3},
        {"replaced_by_resume_at": 3, "step": 4, "reward_mean": 0.4},
    ]
    # a second resume, from step 1, appends to the side file: nothing logged is ever lost
    logger = MetricsLogger(tmp_path, {}, enabled=True, plot_every=0, resume=True)
    logger.truncate_after(1)
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.0}]
    assert read_jsonl(tmp_path / "metrics.replaced.jsonl")[2:] == [
        {"replaced_by_resume_at": 1, "step": 1, "reward_mean": 0.1},
        {"replaced_by_resume_at": 1, "step": 2, "reward_mean": 0.2},
        {"replaced_by_resume_at": 1, "step": 3, "reward_mean": 0.9},
    ]
    # resuming at a step past the end replaces nothing and leaves the side file alone
    logger = MetricsLogger(tmp_path, {}, enabled=True, plot_every=0, resume=True)
    logger.truncate_after(5)
    logger.close()
    assert len(read_jsonl(tmp_path / "metrics.replaced.jsonl")) == 5
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.0}]


def test_fresh_run_never_destroys_metrics(tmp_path):
    logger = MetricsLogger(tmp_path, {"run": 1}, enabled=True, plot_every=0)
    logger.log(0, {"reward_mean": 0.5})
    logger.close()
    before = sorted(os.listdir(tmp_path))
    # resume=False over a non-empty metrics.jsonl: refused, nothing touched
    with pytest.raises(FileExistsError, match="metrics.jsonl"):
        MetricsLogger(tmp_path, {"run": 2}, enabled=True, plot_every=0)
    assert sorted(os.listdir(tmp_path)) == before
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.5}]
    assert json.load(open(tmp_path / "config.json")) == {"run": 1}
    # overwrite=True: the old files are moved aside, byte for byte, and the new run starts empty
    logger = MetricsLogger(tmp_path, {"run": 2}, enabled=True, plot_every=0, overwrite=True)
    logger.log(0, {"reward_mean": 0.25})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.25}]
    assert json.load(open(tmp_path / "config.json")) == {"run": 2}
    old_metrics = [n for n in os.listdir(tmp_path) if n.startswith("metrics.jsonl.old-")]
    old_config = [n for n in os.listdir(tmp_path) if n.startswith("config.json.old-")]
    assert len(old_metrics) == 1 and len(old_config) == 1
    assert read_jsonl(tmp_path / old_metrics[0]) == [{"step": 0, "reward_mean": 0.5}]
    assert json.load(open(tmp_path / old_config[0])) == {"run": 1}
    # a second overwrite in the same second does not clobber the first one's copy
    MetricsLogger(tmp_path, {"run": 3}, enabled=True, plot_every=0, overwrite=True).close()
    assert len([n for n in os.listdir(tmp_path) if n.startswith("metrics.jsonl.old-")]) == 2
    # an empty metrics.jsonl (a run that died before its first step) is no run to protect
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    MetricsLogger(empty, {}, enabled=True, plot_every=0).close()
    assert sorted(os.listdir(empty)) == ["config.json", "metrics.jsonl"]


def test_wandb_offline_run_dir(tmp_path, monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    logger = MetricsLogger(
        tmp_path, {"lr": 0.1}, wandb_mode="offline", project="test", run_name="unit", enabled=True, plot_every=0
    )
    logger.log(0, {"reward_mean": 1.0})
    logger.log(1, {"reward_mean": 2.0})
    run_id = logger.wandb_run.id
    logger.close()
    run_dirs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(run_dirs) == 1 and run_dirs[0].endswith(run_id)
    assert os.path.exists(tmp_path / "wandb" / run_dirs[0] / f"run-{run_id}.wandb")
    assert (tmp_path / "wandb_run_id").read_text() == run_id


def test_default_wandb_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_wandb_mode() == "disabled"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert default_wandb_mode() == "online"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert default_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert default_wandb_mode() == "offline"


def test_run_record(tmp_path):
    layout = {"world_size": 2, "tp": 2, "pp": 1, "dp": 1}
    record = run_record({"lr": 1e-6, "out": tmp_path, "steps": 3}, layout)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert record["git"] == {"commit": head, "dirty": dirty}
    for name in ("torch", "megatron-core", "transformers", "numpy"):
        assert record["versions"][name] == importlib.metadata.version(name)
    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    assert record["versions"]["vllm"] == vllm_version
    assert "vllm" not in sys.modules  # read from metadata, never imported
    assert record["versions"]["python"] == platform.python_version()
    assert record["hostname"] == socket.gethostname()
    assert record["layout"] == layout
    assert record["args"] == {"lr": 1e-6, "out": str(tmp_path), "steps": 3}  # a Path becomes a str
    assert json.loads(json.dumps(record)) == record
    # MetricsLogger writes it as config.json, unchanged
    MetricsLogger(tmp_path / "run", record, enabled=True, plot_every=0).close()
    assert json.load(open(tmp_path / "run" / "config.json")) == record


def test_run_record_without_git(monkeypatch):
    """No git binary on PATH (a bare container): the record says None instead of failing."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert run_record({}, {})["git"] is None


def test_run_record_outside_a_checkout(tmp_path):
    from common.run.log import git_state

    assert git_state(str(tmp_path)) is None


def _known_warning(message, category, module):
    """Emit a warning attributed to `module`, as if that module had called warnings.warn."""
    warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)


def test_quiet_known_warnings_filters_only_known(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(rank=0, on_gpu=False)
        _known_warning(
            "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
            UserWarning,
            "megatron.core.transformer.transformer_config",
        )
        _known_warning(
            "When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
            UserWarning,
            "megatron.core.tensor_parallel.layers",
        )
        _known_warning(  # megatron's optimizer reading .grad, through the CPU adapter's TorchFunctionMode
            "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute won't "
            "be populated during autograd.backward().",
            UserWarning,
            "common.model.cpu_compat",
        )
        warnings.warn("something new went wrong", UserWarning)
        # a known message from another module is not the known warning: it shows
        _known_warning("Apex is not installed. Falling back to Torch Norm", UserWarning, "mylib.norms")
    assert [str(w.message) for w in caught] == [
        "something new went wrong",
        "Apex is not installed. Falling back to Torch Norm",
    ]
    # on a GPU the CUDA_DEVICE_MAX_CONNECTIONS hint is real advice: it shows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(rank=0, on_gpu=True)
        _known_warning(
            "When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
            UserWarning,
            "megatron.core.tensor_parallel.layers",
        )
    assert len(caught) == 1 and "CUDA_DEVICE_MAX_CONNECTIONS" in str(caught[0].message)


def test_quiet_known_warnings_of_loading_a_checkpoint(monkeypatch):
    """--resume and merge_to_hf.py load a megatron checkpoint: megatron-core's torch_dist loader
    calls torch's deprecated load_state_dict and builds ShardedTensors (both FutureWarnings,
    the second attributed to the frame of the torch call: megatron's, or on a CPU the adapter
    common/model/cpu_compat.py, which also passes on megatron's non-leaf .grad read). Silenced;
    the same words from another module still show."""
    monkeypatch.setattr(sys, "warnoptions", [])
    load = "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead."
    sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
    grad = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute ..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(rank=0, on_gpu=False)
        _known_warning(load, FutureWarning, "megatron.core.dist_checkpointing.strategies.torch")
        _known_warning(sharded, FutureWarning, "megatron.core.dist_checkpointing.strategies.torch")
        _known_warning(sharded, FutureWarning, "common.model.cpu_compat")
        _known_warning(grad, UserWarning, "common.model.cpu_compat")
        _known_warning(sharded, FutureWarning, "mylib.checkpoints")
    assert [str(w.message) for w in caught] == [sharded]


def test_quiet_known_warnings_other_ranks_silent(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("RANK", "1")  # as torchrun sets it, before init_process_group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("something new went wrong", UserWarning)
    assert caught == []
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("something new went wrong", UserWarning)
    assert len(caught) == 1


def test_quiet_known_warnings_defers_to_user_filters(monkeypatch):
    """-W / PYTHONWARNINGS given: the user's filters alone decide."""
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(rank=1)
        warnings.warn("something new went wrong", UserWarning)
    assert len(caught) == 1


# In a fresh process: for each case, the call, then the import of a stand-in vllm that reports
# the level a real vllm would configure its logger with (read once, at import), then a megatron
# INFO and WARNING line. Cases: (verbose, rank, an explicit VLLM_LOGGING_LEVEL or None).
THIRD_PARTY_LOGGING_SCRIPT = """
import json, logging, os, sys
from common.run.console import quiet_third_party_logging
for case in json.loads(sys.argv[1]):
    verbose, rank, user_level = case
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    if user_level:
        os.environ["VLLM_LOGGING_LEVEL"] = user_level
    sys.modules.pop("vllm", None)
    quiet_third_party_logging(verbose=verbose, rank=rank)
    import vllm
    megatron = logging.getLogger("megatron.core.distributed")
    print(f"CASE {case}", file=sys.stderr, flush=True)
    megatron.info("megatron info line")
    megatron.warning("megatron warning line")
    print("RESULT " + json.dumps([vllm.LEVEL, logging.getLogger("megatron.core").level]), flush=True)
"""


def test_quiet_third_party_logging(tmp_path):
    """vLLM's level reaches it through the environment before it is imported; megatron-core's
    logger level is set (rank 0: warnings, other ranks: errors only); an explicit
    VLLM_LOGGING_LEVEL wins; verbose brings INFO back, megatron-core's printed to stderr."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import os\nLEVEL = os.environ.get('VLLM_LOGGING_LEVEL')\n")
    cases = [[False, 0, None], [False, 1, None], [False, 0, "DEBUG"], [True, 1, None]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-c", THIRD_PARTY_LOGGING_SCRIPT, json.dumps(cases)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results == [["WARNING", 30], ["ERROR", 40], ["DEBUG", 30], ["INFO", 20]]
    printed = proc.stderr.split("CASE ")[1:]  # what each case printed
    assert ["megatron warning line" in p for p in printed] == [True, False, True, True]
    assert ["INFO megatron.core.distributed: megatron info line" in p for p in printed] == [False, False, False, True]


def test_quiet_third_party_logging_after_vllm_import(monkeypatch):
    """vllm imported already: its logger's level is set directly."""
    import logging
    import types

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    vllm_logger, megatron_logger = logging.getLogger("vllm"), logging.getLogger("megatron.core")
    before = vllm_logger.level, megatron_logger.level
    try:
        quiet_third_party_logging(rank=0)
        assert (vllm_logger.level, megatron_logger.level) == (logging.WARNING, logging.WARNING)
    finally:
        vllm_logger.setLevel(before[0])
        megatron_logger.setLevel(before[1])


# The real third-party calls behind each KNOWN_HARMLESS_WARNINGS entry, in a fresh process (some
# warn at import, once per process), plus an unknown warning and the grad-access message
# triggered from this script itself, which must still show.
REAL_WARNINGS_SCRIPT = """
import sys, warnings
import torch
import torch.distributed as dist
if sys.argv[1] == "quiet":
    from common.run.console import quiet_known_warnings
    quiet_known_warnings(rank=0, on_gpu=False)
import megatron.core.optimizer                      # TE/apex fallback notices (import time)
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.optimizer.optimizer import _zero_grad_group_helper
from megatron.core.transformer import TransformerConfig
gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")   # Apex norm fallback
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)  # cuda_graph_scope "full"
leaf = torch.ones(2, requires_grad=True)
_zero_grad_group_helper([leaf * 2], set_to_none=True)   # megatron reads .grad of a non-leaf
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
dist.destroy_process_group()
warnings.warn("something new went wrong")
(leaf * 2).grad   # the same message as megatron's, from this script: a real mistake, shows
"""


def _warnings_printed(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", REAL_WARNINGS_SCRIPT, mode, str(tmp_path / f"store-{mode}")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # "path:line: Category: message" lines of the default warning printer
    return [line.split("Warning: ", 1)[1] for line in proc.stderr.splitlines() if "Warning: " in line]


def test_real_third_party_warnings_filtered(tmp_path):
    loud = _warnings_printed(tmp_path, "loud")
    quiet = _warnings_printed(tmp_path, "quiet")
    # without the filters, every known warning prints (else this test could not fail)
    for start in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed. Falling back",
        "full scope is deprecated",
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        "`torch.distributed.reduce_scatter_tensor` is deprecated",
        "The .grad attribute of a Tensor that is not a leaf",
    ):
        assert any(m.startswith(start) for m in loud), (start, loud)
    grad_message = [m for m in loud if m.startswith("The .grad attribute")][0]
    assert quiet == ["something new went wrong", grad_message]


def test_startup_clock_says_where_the_start_up_went(monkeypatch):
    """common/run/startup.py: seconds between marks go to the stage marked, repeated stages add up,
    stages under half a second are left out of the line."""
    from common.run import startup

    now = [100.0]
    monkeypatch.setattr(startup.time, "time", lambda: now[0])
    clock = startup.StartupClock()
    for stage, seconds in [("engine", 46.2), ("policy", 38.0), ("set-up", 0.2), ("pinned host memory", 20.4)]:
        now[0] += seconds
        clock.mark(stage)
    now[0] += 3.6
    clock.mark("pinned host memory")
    assert clock.parts["pinned host memory"] == pytest.approx(24.0)
    assert clock.line() == "start-up 108 s: engine 46, policy 38, pinned host memory 24"
