"""Training checkpoints (common/train/save.py, train_resume.py, checkpoint_io.py): exact
resume at the same layout and at other TP/PP/DP layouts, background saves, refusals, damaged
checkpoints.

    .venv/bin/python -m pytest tests/test_train_checkpoint.py -q

Six launches of tests/checkpoint_worker.py (gloo, CPU), each running several jobs:
  reference  1 process: the uninterrupted 5-step Adam run (with a PPO critic as extra model),
             checkpoints after steps 2, 3, 4 (fully_reshardable, the default), a step-3
             checkpoint in dp_reshardable (and one written in the background), and the same
             run with a plain optimizer (--no-distributed-optimizer: a background save too).
             It ends like train_grpo.py with vLLM (os._exit) and must close its stdout.
  tp2, pp2   2 processes at TP=2 / PP=2: the dp_reshardable checkpoint is refused, naming
             both layouts; resume from step 3 (both optimizer kinds), save after step 4; at
             PP=2 also on uneven stages of 3 + 1 layers (a dp_reshardable save of the even
             stages is refused there); at TP=2 the step-4 checkpoint is also resumed at the
             same layout (each rank's own RNG states, megatron's tracker included);
  dp2        2 processes at DP=2: the same, plus a save with a NaN (refused), a background
             save whose writes fail on one rank (raised on both) and one whose writer is
             held on one rank (not published before it is written everywhere);
  one rank   1 process: resume the TP=2, PP=2, DP=2 checkpoints, and the damaged reference
             root at the same layout (falls back, bit-identical, RNG states identical);
  control    1 process that makes megatron's own results queue first (served by a spawned
             Manager process), saves and leaves by os._exit: that helper process keeps its
             stdout open (what the reference run must not do).
Every step draws its batch from the python, numpy and torch RNGs, so the losses after a
resume only match if the RNG states were restored; megatron's tracker (per TP rank) is
compared by fingerprint: restored at the same TP/EP coordinates, else kept as seeded. After a
resume at another layout the losses, grad norms and final weights match the uninterrupted run
to <= 1e-5 relative (fp32, another summation order); the LRs exactly.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_torchrun

WORKER = "tests/checkpoint_worker.py"
REL_TOL = 1e-5


def save_tiny_model_vocab256(out_dir):
    """tests/tiny_models.py's qwen2 with a vocabulary of 256: megatron pads the vocabulary to a
    multiple of 128*TP, so 256 rows are the same at TP=1 and TP=2 (300 would be 384 vs 512,
    and the model's loss, a softmax over the padded vocabulary, would differ)."""
    import torch
    import transformers

    from tests.tiny_models import ARCH_CONFIGS

    arch, kwargs = ARCH_CONFIGS["qwen2"]
    config = transformers.Qwen2Config(**dict(kwargs, vocab_size=256))
    config.architectures = [arch]
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out_dir)


def worker_args(tmp, jobs):
    return ["--hf-dir", tmp / "hf", "--out-dir", tmp / "out", "--jobs", json.dumps(jobs, default=str)]


def run_to_eof(args, timeout=300, eof_within=30):
    """Run one plain worker process with stdout and stderr on a pipe, as `python x.py | tee log`
    does; returns (exit code, output, seconds from exit to the pipe's end, or None if it did not
    end within eof_within). The pipe ends only when every process holding it has exited."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    import threading

    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(65536), b"")), daemon=True)
    reader.start()
    code = proc.wait(timeout=timeout)
    exited = time.monotonic()
    reader.join(eof_within)
    eof_after = None if reader.is_alive() else time.monotonic() - exited
    return code, b"".join(chunks).decode(errors="replace"), eof_after, reader


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    save_tiny_model_vocab256(str(tmp / "hf"))
    (tmp / "out").mkdir()
    r = {name: tmp / name for name in ("root", "full2", "fullbg", "full3", "dp", "dpbg", "nd", "ndbg")}
    (r["root"] / "step_000001.tmp").mkdir(parents=True)  # an interrupted save from an earlier run
    (r["root"] / "step_000001.tmp" / "__0_0.distcp").write_bytes(b"partial")
    jobs = [
        {
            "name": "ref",
            "critic": True,
            "compare_model_space_at": 2,
            "saves": [
                *({"step": s, "root": r["root"], "meta": True} for s in (2, 3, 4)),
                # any-layout state of one DP rank, without megatron's gather (model_space_optimizer_state),
                # in the background while step 3 changes everything
                {"step": 2, "root": r["full2"]},
                {"step": 2, "root": r["fullbg"], "background": True, "hold_until": 3},
                {"step": 3, "root": r["full3"]},
                {"step": 3, "root": r["dp"], "sharding": "dp_reshardable"},
                # held (a slow disk) until step 4 has changed every parameter and Adam moment
                # ... and its first file write fails once (as torch's serializer did on a GPU): written again
                {
                    "step": 3,
                    "root": r["dpbg"],
                    "sharding": "dp_reshardable",
                    "background": True,
                    "hold_until": 4,
                    "fail_first_write": True,
                },
            ],
        },
        {
            "name": "ref_plain",
            "dist_opt": False,
            "exit_hard": True,
            "saves": [
                {"step": 3, "root": r["nd"]},
                {"step": 3, "root": r["ndbg"], "background": True, "hold_until": 4},
            ],
        },
    ]
    code, output, eof_after, _ = run_to_eof(worker_args(tmp, jobs))
    assert code == 0, output[-5000:]
    # The newest checkpoint loses one of its files; an interrupted newer save is left behind.
    damaged = tmp / "damaged"
    shutil.copytree(r["root"], damaged)
    distcp = sorted(p for p in os.listdir(damaged / "step_000004") if p.endswith(".distcp"))
    os.remove(damaged / "step_000004" / distcp[-1])
    (damaged / "step_000009.tmp").mkdir()
    (damaged / "step_000009.tmp" / "complete").write_text("{}")
    return dict(
        tmp=tmp,
        **r,
        damaged=damaged,
        removed=distcp[-1],
        eof_after=eof_after,
        output=output,
        ref=load(tmp, "ref"),
        ref_plain=load(tmp, "ref_plain"),
    )


def load(tmp, name):
    with open(tmp / "out" / f"{name}.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def resharded(reference):
    """tp2, pp2, dp2 launches, each resuming the 1-process step-3 checkpoints."""
    tmp, r = reference["tmp"], reference
    out = {}
    for layout, flags in (("tp2", ["--tp", 2]), ("pp2", ["--pp", 2]), ("dp2", [])):
        jobs = [
            {
                "name": layout,
                "resume": r["full3"],
                "try_first": [r["dp"]],
                "saves": [{"step": 4, "root": tmp / f"{layout}_4"}],
            },
            {
                "name": f"{layout}_plain",
                "dist_opt": False,
                "resume": r["nd"],
                "saves": [{"step": 4, "root": tmp / f"{layout}_plain_4"}],
            },
        ]
        if layout == "pp2":  # uneven stages: megatron's num_layers_in_first_pipeline_stage
            jobs[0]["saves"].append({"step": 4, "root": tmp / "pp2_4dp", "sharding": "dp_reshardable"})
            jobs.append(
                {"name": "pp2_uneven", "first_stage_layers": 3, "resume": r["full3"], "try_first": [tmp / "pp2_4dp"]}
            )
        if layout == "tp2":  # the same layout: each rank restores its own RNG states, megatron's tracker too
            jobs.append({"name": "tp2_same", "resume": tmp / "tp2_4"})
        if layout == "dp2":
            jobs[0].update(nan_save_at=4, fail_save_at=4, compare_model_space_at=4)
            jobs[0]["saves"].append({"step": 4, "root": tmp / "dp2_4bg", "background": True, "hold_until": 5})
            jobs.append({"name": "dp2_dpresh", "resume": r["dp"]})  # dp_reshardable at another DP: fine
        run_torchrun(WORKER, 2, *flags, *worker_args(tmp, jobs))
        out.update({job["name"]: load(tmp, job["name"]) for job in jobs})
    return out


@pytest.fixture(scope="module")
def one_rank(reference, resharded):
    """One process: the damaged reference root at the same layout, then every checkpoint
    written at TP=2, PP=2, DP=2."""
    tmp, r = reference["tmp"], reference
    jobs = [
        {
            "name": "same",
            "critic": True,
            "resume": r["damaged"],
            "try_first": [r["nd"]],
            "break_copy": tmp / "all_damaged",
        },
        {"name": "same_plain", "dist_opt": False, "resume": r["nd"], "try_first": [r["full3"]]},
    ]
    jobs += [
        {"name": f"from_{name}", "dist_opt": "plain" not in name, "resume": tmp / f"{name}_4"}
        for name in ("tp2", "pp2", "dp2", "tp2_plain", "pp2_plain", "dp2_plain")
    ]
    code, output, _, _ = run_to_eof(worker_args(tmp, jobs))
    assert code == 0, output[-5000:]
    return dict(output=output, **{job["name"]: load(tmp, job["name"]) for job in jobs})


def rel_diff(result, reference, key):
    return max(abs(result[key][s] - reference[key][s]) / abs(reference[key][s]) for s in result[key])


def weights_rel_diff(tmp, name, reference_name):
    """Largest difference of the final full weights, relative to each tensor's largest value.

    Except the k_proj biases: a constant added to every key adds the same q.b_k to all scores
    of a query, which the softmax ignores, so their true gradient is 0 and Adam (m/sqrt(v))
    turns the rounding noise of the computed one into updates of ~1e-5 that depend on the
    summation order (measured at TP=2 and DP=2: up to 4e-5 absolute, 1.6e-3 relative; every
    other tensor <= 9e-7 relative). They are only checked to stay within 1e-3 absolute."""
    import torch

    got, want = (torch.load(tmp / "out" / f"{n}.pt") for n in (name, reference_name))
    assert got.keys() == want.keys()
    for k in (k for k in want if k.endswith("k_proj.bias")):
        assert (got[k] - want[k]).abs().max() <= 1e-3, k
    return max(
        ((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want if not k.endswith("k_proj.bias")
    )


def dcp_contents(step_dir, tmp_file):
    """Every tensor and object of a dist_checkpointing directory, read without a process group,
    plus its common.pt: what a load at any layout would see."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, tmp_file)
    return torch.load(tmp_file, weights_only=False), torch.load(step_dir / "common.pt", weights_only=False)


def assert_same_checkpoint(a, b, tmp):
    import torch

    (tensors_a, common_a), (tensors_b, common_b) = dcp_contents(a, tmp / "a.pt"), dcp_contents(b, tmp / "b.pt")
    assert tensors_a.keys() == tensors_b.keys()
    assert any(k.startswith("optimizer.") for k in tensors_a)  # optimizer state is in there
    for key, value in tensors_a.items():
        assert torch.equal(value, tensors_b[key]) if torch.is_tensor(value) else value == tensors_b[key], key
    assert repr(common_a) == repr(common_b)
    state_a, state_b = (json.loads((d / "train_state.json").read_text()) for d in (a, b))
    assert state_a == state_b
    for rng in os.listdir(a / "rng"):
        assert (a / "rng" / rng).read_bytes() == (b / "rng" / rng).read_bytes()


# --- saving ---------------------------------------------------------------------------------
def test_save_layout_keep_last_and_tmp_cleanup(reference):
    root = reference["root"]
    # keep_last=2 after saves at 2, 3, 4; the interrupted step_000001.tmp was cleaned up
    assert sorted(os.listdir(root)) == ["latest", "step_000003", "step_000004"]
    assert (root / "latest").read_text().strip() == "step_000004"
    step_dir = root / "step_000004"
    files = json.loads((step_dir / "complete").read_text())["files"]
    assert {
        "metadata.json",
        "train_state.json",
        "rl_meta.json",
        "rng/rank_00000.pt",
        "critic/metadata.json",
        "critic/.metadata",
    } <= set(files)
    assert all(os.path.getsize(step_dir / rel) == size for rel, size in files.items())
    state = json.loads((step_dir / "train_state.json").read_text())
    assert state["extra"] == {"step": 4, "samples_seen": 16}
    assert state["scheduler"]["num_steps"] == 4 and state["optimizer_sharding"] == "fully_reshardable"
    assert state["extra_models"]["critic"]["scheduler"]["num_steps"] == 4
    assert state["layout"]["dp"] == 1 and state["distributed_optimizer"] is True


def test_background_save_equals_synchronous_save(reference, resharded, tmp_path):
    """A background save is the synchronous save of the same step, file content for file
    content, although its writer was held until the next step had changed every parameter and
    Adam moment (staging copies); `latest` and step_N appear only at the poll after the write.
    The dp_reshardable one had a file write fail once: written again, the same files."""
    tmp = reference["tmp"]
    assert len(reference["ref"]["injected_write_failures"]) == 1  # one writer thread hit it
    for job, sync_root, root, step in (
        (reference["ref"], reference["dp"], reference["dpbg"], 3),
        (reference["ref_plain"], reference["nd"], reference["ndbg"], 3),
        (resharded["dp2"], tmp / "dp2_4", tmp / "dp2_4bg", 4),
    ):
        saves = job["saves"]
        assert saves[f"{root}@{step}"] == {"latest_unchanged": True, "step_dir_absent": True}
        # the poll of the step during which the writer was held published nothing, on any rank
        assert saves["while_held"] == {"poll": None, "latest": None, "step_dir_exists": False}
        published = saves.get(f"published_at_{step + 2}") or saves.get("published_at_end")
        assert published == str(root / f"step_{step:06d}")
        assert (root / "latest").read_text().strip() == f"step_{step:06d}"
        assert_same_checkpoint(sync_root / f"step_{step:06d}", root / f"step_{step:06d}", tmp_path)


def test_model_space_optimizer_state_equals_megatrons(reference, resharded, tmp_path):
    """At one DP rank the any-layout optimizer state is built from views of the live state
    (common/training.model_space_optimizer_state): entry for entry (order, keys, metadata,
    values) what megatron's gather builds; at DP=2 megatron's own path is used. Its background
    save (held until step 3 changed every tensor) is the synchronous one, file for file."""
    assert reference["ref"]["model_space"] == {
        "entries": reference["ref"]["model_space"]["entries"],
        "same_keys_in_order": True,
        "metadata_differs": [],
        "values_differ": [],
        "rest_equal": True,
    }
    assert reference["ref"]["model_space"]["entries"] >= 3 * 10  # param, exp_avg, exp_avg_sq per param
    assert resharded["dp2"]["model_space"] is None
    assert (reference["fullbg"] / "latest").read_text().strip() == "step_000002"
    assert_same_checkpoint(reference["full2"] / "step_000002", reference["fullbg"] / "step_000002", tmp_path)


def test_host_staging_copies_own_exactly_their_bytes(tmp_path):
    """A staged copy (a slice of HostStaging's one buffer) is a tensor of its own storage:
    serialized, it writes its bytes, not the buffer's (a view did, and the GPU save failed);
    values and dtypes survive; what does not fit is copied the plain way."""
    import torch

    from common.train.checkpoint_io import HostStaging

    staging = HostStaging()
    staging.reserve(HostStaging.nbytes_for([]) + 256)
    a, b = torch.arange(10, dtype=torch.float32), torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    copies = [staging._copy(a), staging._copy(b), staging._copy(torch.ones(100))]  # 40 + 12 bytes fit, 400 not
    assert [c.untyped_storage().nbytes() for c in copies] == [40, 12, 400]
    assert staging.overflow_bytes == 400 and staging.used == 64 + 12  # aligned to 64 bytes
    a += 1  # the live tensor moves on; the copy does not
    torch.save(copies, tmp_path / "staged.pt")
    torch.save([c.clone() for c in copies], tmp_path / "clones.pt")
    assert os.path.getsize(tmp_path / "staged.pt") == os.path.getsize(tmp_path / "clones.pt")
    loaded = torch.load(tmp_path / "staged.pt")
    assert torch.equal(loaded[0], torch.arange(10, dtype=torch.float32)) and torch.equal(loaded[1], b)
    assert loaded[1].dtype == torch.bfloat16 and loaded[1].shape == (2, 3)


def test_host_staging_keeps_each_model_of_one_save():
    """One save of several models (PPO: the policy, then the critic) stages them in turn into
    the one buffer while the policy's files are being written: the critic's copies must go
    after the policy's, not over them (on a GPU the policy's checkpoint held the critic's
    bytes in its first tensors). clear(), at the next save, reuses the buffer."""
    import torch

    from common.train.checkpoint_io import HostStaging

    policy = [torch.arange(10, dtype=torch.float32), torch.full((3, 4), 2.0, dtype=torch.bfloat16)]
    critic = [torch.full((10,), -1.0), torch.full((3, 4), -2.0, dtype=torch.bfloat16)]
    live = {t.untyped_storage().data_ptr() for t in policy + critic}
    # CPU tensors of the live state take the GPU tensors' path (copied into the buffer), as on a GPU machine
    staging = HostStaging(include_cpu=True)
    staging.reserve(HostStaging.nbytes_for(policy + critic, include_cpu=True))

    def bucket(tensors):  # megatron's write bucket: (file, key, (byte items, [(item, tensor)]))
        return [("__0_0.distcp", "k", ([], list(enumerate(tensors))))]

    for _ in range(2):  # two saves, each of both models
        staging.clear()
        staged = [staging.stage(bucket(tensors), live=live) for tensors in (policy, critic)]
        for (_, _, (_, items)), tensors in zip((s[0] for s in staged), (policy, critic)):
            for (_, copy), tensor in zip(items, tensors):
                assert torch.equal(copy, tensor) and copy.dtype == tensor.dtype
                assert copy.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        assert staging.overflow_bytes == 0 and staging.used == 64 + 64 + 64 + 24  # 64-byte aligned


def test_nonfinite_weights_refused_before_writing(resharded):
    nan = resharded["dp2"]["nan"]
    assert nan["errors_agree"] and not nan["root_exists"] and nan["error_type"] == "NonFiniteError"
    assert nan["error"].startswith("refusing to write the training checkpoint of step 4: non-finite values")
    assert "rank 1: decoder.layers.3.mlp.linear_fc2.weight" in nan["error"]


def test_background_write_failure_raised_on_every_rank(resharded):
    """The last rank cannot write its files (File too large): wait() raises the same error on
    both ranks, naming that rank, once for its two files (CI once saw it twice, the free space
    measured after each file 10 MB apart); nothing is published; the run went on to a good save."""
    fail = resharded["dp2"]["fail"]
    assert fail["errors_agree"]
    assert re.match(
        r"writing the training checkpoint \S+dp2_fail/step_000004.tmp failed \(the checkpoint "
        r"before it is kept\): rank 1: OSError: \[Errno 27\] File too large "
        r"\(2 files; [0-9.]+ [MG]B free on its filesystem\)$",
        fail["error"],
    ), fail["error"]
    assert fail["listing"] == ["step_000004.tmp"]  # no latest, no step_000004


def test_exit_closes_stdout(reference, tmp_path):
    """The reference run saved (synchronously and in the background) and left like
    train_grpo.py with vLLM, os._exit after CheckpointWriter.wait(): its stdout pipe ended
    with it, and megatron started no results-queue Manager (common/train/checkpoint_io.py:
    in_process_results). Control: with megatron's own queue made first, its helper process
    holds the pipe (so the check above can fail); that process is then ended here by its pid."""
    assert reference["eof_after"] is not None and reference["eof_after"] < 5
    assert "results-queue Manager: pid None" in reference["output"]
    tmp = reference["tmp"]
    jobs = [
        {
            "name": "control",
            "exit_hard": True,
            "megatron_queue": True,
            "saves": [{"step": 1, "root": tmp_path / "control"}],
        }
    ]
    code, output, eof_after, reader = run_to_eof(worker_args(tmp, jobs), eof_within=5)
    assert code == 0 and eof_after is None, "the control's pipe ended: the test above could not fail"
    os.kill(int(re.search(r"results-queue Manager: pid (\d+)", output).group(1)), signal.SIGTERM)
    reader.join(30)
    assert not reader.is_alive()


# --- resuming -------------------------------------------------------------------------------
def test_resume_same_layout_after_fallback_and_all_damaged(reference, one_rank):
    """The damaged root at the saved layout: falls back to step 3; both models, optimizers and
    schedules continue bit-identically, the RNG states are the saved ones."""
    ref, result = reference["ref"], one_rank["same"]
    assert (
        f"skipping damaged checkpoint {reference['damaged']}/step_000004: {reference['removed']} is missing"
        in one_rank["output"]
    )
    assert result["extra"] == {"step": 3, "samples_seen": 12}  # fell back; step_000009.tmp ignored
    for key in ["losses", "grad_norms", "lrs", "critic_losses", "critic_grad_norms", "critic_lrs"]:
        assert all(result[key][s] == ref[key][s] for s in ("4", "5")), key
    assert result["rng_after_load"] == ref["rng_after_save"]  # global + tracker states
    assert weights_rel_diff(reference["tmp"], "same", "ref") == 0.0
    assert ref["critic_losses"]["5"] < ref["critic_losses"]["1"]  # the critic learns something
    # a root written without the critic: every step refused, by name
    ((error, agree),) = result["try_first"]
    assert "no usable training checkpoint" in error and "critic/metadata.json was never written" in error
    # every checkpoint damaged (one structurally, one only failing inside the load) -> raises
    error = result["all_damaged"]["error"]
    assert "no usable training checkpoint" in error
    assert "step_000004: " + reference["removed"] + " is missing" in error
    assert "step_000003: loading failed" in error


@pytest.mark.parametrize(
    "name", ["tp2", "pp2", "dp2", "tp2_plain", "pp2_plain", "dp2_plain", "dp2_dpresh", "pp2_uneven"]
)
def test_resume_at_another_layout(reference, resharded, name):
    """Step-3 checkpoints of one process resumed at TP=2, PP=2, DP=2 (distributed optimizer
    in fully_reshardable, or a plain optimizer; dp_reshardable only at DP=2), and at PP=2 on
    uneven stages (3 + 1 layers), continue the uninterrupted run."""
    result = resharded[name]
    ref = reference["ref_plain" if "plain" in name else "ref"]
    assert result["extra"]["step"] == 3
    assert rel_diff(result, ref, "losses") <= REL_TOL  # measured: <= 1e-7
    assert rel_diff(result, ref, "grad_norms") <= REL_TOL
    assert rel_diff(result, ref, "lrs") == 0.0
    assert weights_rel_diff(reference["tmp"], name, "ref_plain" if "plain" in name else "ref") <= REL_TOL
    # python/numpy/torch restored on both ranks (the batch is drawn from them)
    assert [fp[0] for fp in result["rng_after_load"]] == [ref["rng_after_save"][0][0]] * 2
    trackers, saved_tracker = [fp[1] for fp in result["rng_after_load"]], ref["rng_after_save"][0][1]
    if name.startswith("tp2"):  # other TP coordinates: megatron's tracker kept as seeded, not the saved one
        assert trackers == [fp[1] for fp in result["rng_before_load"]], "the tracker was changed by the load"
        assert saved_tracker not in trackers, "a tracker saved at TP=1 was restored at TP=2"
    else:  # DP=2, PP=2: the same TP/EP coordinates, megatron's tracker restored
        assert trackers == [saved_tracker] * 2


def test_resume_at_the_same_tp2_layout_restores_each_ranks_own_rng(resharded):
    """Saved at TP=2 after step 4, resumed at TP=2: each rank gets back its own generators and its
    own megatron tracker (the two TP ranks' trackers differ, so a mix-up shows)."""
    saved, result = resharded["tp2"]["rng_at_save"]["4"], resharded["tp2_same"]
    assert result["extra"]["step"] == 4
    assert saved[0][1] != saved[1][1]
    assert result["rng_after_load"] == saved, (
        f"RNG fingerprints (global, tracker) per rank after the load {result['rng_after_load']}, saved {saved}"
    )


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2", "tp2_plain", "pp2_plain", "dp2_plain"])
def test_resume_at_one_rank_from_another_layout(reference, one_rank, name):
    """Step-4 checkpoints written at TP=2, PP=2, DP=2 resumed by one process."""
    result = one_rank[f"from_{name}"]
    ref = reference["ref_plain" if "plain" in name else "ref"]
    assert result["extra"]["step"] == 4
    assert rel_diff(result, ref, "losses") <= REL_TOL
    assert rel_diff(result, ref, "grad_norms") <= REL_TOL
    assert rel_diff(result, ref, "lrs") == 0.0
    assert weights_rel_diff(reference["tmp"], f"from_{name}", "ref_plain" if "plain" in name else "ref") <= REL_TOL


def test_refusals_name_both_layouts_and_never_fall_back(reference, resharded, one_rank):
    """A dp_reshardable checkpoint at another TP or PP, or a checkpoint of the other optimizer
    kind, is refused with what to do -- not called damaged, no older step tried."""
    dp_dir = reference["dp"] / "step_000003"
    for layout, current in (("tp2", "TP=2 PP=1"), ("pp2", "TP=1 PP=2")):
        ((error, agree),) = resharded[layout]["try_first"]
        assert agree and error.startswith(
            f"{dp_dir} holds distributed-optimizer state in optimizer_sharding='dp_reshardable'"
        )
        assert "saved at TP=1 PP=1 VPP=1 EP=1 CP=1 DP=1 (1 ranks)" in error
        assert f"this run is at {current} VPP=1 EP=1 CP=1 DP=1 (2 ranks)" in error
        assert "optimizer_sharding='fully_reshardable'" in error and "damaged" not in error
    ((error, agree),) = resharded["pp2_uneven"]["try_first"]  # same PP, other layers per stage
    assert agree and error.startswith(f"{reference['tmp']}/pp2_4dp/step_000004 holds distributed-optimizer state")
    assert "(2 ranks), layers per stage [2, 2]" in error and "(2 ranks), layers per stage [3, 1]" in error
    ((error, _),) = one_rank["same_plain"]["try_first"]
    assert error.startswith(
        f"{reference['full3']}/step_000003 was written with the distributed optimizer; this run uses a plain optimizer"
    )
    assert one_rank["same_plain"]["extra"]["step"] == 3  # the right kind then loads


def test_check_step_dir_andcandidates(reference, tmp_path):
    """The structural checks, without any process group."""
    from common.train.checkpoint_dirs import candidates
    from common.train.resume import check_step_dir

    root = tmp_path / "root"
    shutil.copytree(reference["root"], root)
    good = root / "step_000004"
    assert check_step_dir(str(good)) is None
    distcp = sorted(p for p in os.listdir(good) if p.endswith(".distcp"))[0]
    with open(good / distcp, "r+b") as f:
        f.truncate(100)
    assert "truncated" in check_step_dir(str(good))
    os.remove(root / "step_000003" / "complete")
    assert "no 'complete' marker" in check_step_dir(str(root / "step_000003"))
    assert "does not exist" in check_step_dir(str(root / "step_000007"))

    # latest first, then older; unpublished newer dirs and interrupted saves are ignored
    (root / "step_000005").mkdir()
    (root / "step_000006.tmp").mkdir()
    assert candidates(str(root)) == ["step_000004", "step_000003"]
    os.remove(root / "latest")
    assert candidates(str(root)) == ["step_000005", "step_000004", "step_000003"]
    assert candidates(str(tmp_path / "nothing_here")) == []
