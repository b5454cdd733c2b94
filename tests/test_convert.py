"""End-to-end tests of convert_hf_to_mcore.py and merge_to_hf.py.

    .venv/bin/python -m pytest -q tests/test_convert.py

Ground truth: the HF safetensors bytes (HF -> mcore -> HF must be bit-exact), megatron's
own dist_checkpointing save of the same model (the converter must write the same keys,
shapes, chunks and values), and transformers' logits (--verify, and the merged directory
loaded with from_pretrained). Most cases run the scripts' main() in this process (fast);
the multi-rank ones run them under torchrun on gloo.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import convert_hf_to_mcore  # noqa: E402  (the repo root is on sys.path via conftest)
import merge_to_hf  # noqa: E402
from tests.conftest import ROOT, assert_every_flag_documented, run_script, run_torchrun
from tests.tiny_models import ARCH_CONFIGS, make_tiny_hf_model


def convert(*args):
    return convert_hf_to_mcore.main([str(a) for a in args])


def merge(*args):
    return merge_to_hf.main([str(a) for a in args])


def hf_tensors(hf_dir):
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, name)))
    return tensors


def assert_bit_exact(expected, actual):
    assert sorted(expected) == sorted(actual), set(expected) ^ set(actual)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def snapshot(*dirs):
    """path -> (size, mtime, sha1) of every file under dirs (to prove nothing was touched)."""
    state = {}
    for d in dirs:
        for dirpath, _, filenames in os.walk(d):
            for name in filenames:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    state[path] = (os.path.getsize(path), os.path.getmtime(path), hashlib.sha1(f.read()).hexdigest())
    return state


def max_abs_diff(text):
    return float(re.search(r"max_abs_diff=(\S+)", text).group(1))


# ---------------------------------------------------------------------------------------
# round trips, in this process
# ---------------------------------------------------------------------------------------
def test_roundtrip_every_architecture(tiny_models_dir, tmp_path, capsys):
    """fp32: HF -> mcore (--verify at TP=1) -> HF is bit-exact for every tiny architecture
    (qwen3 is sharded on input; qwen2_tied and llama have tied embeddings), and the merged
    directory loads with transformers and gives the same logits."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for name in ARCH_CONFIGS:
        hf_dir, ckpt, out = tiny_models_dir / name, tmp_path / f"{name}-mcore", tmp_path / f"{name}-hf"
        assert convert("--hf", hf_dir, "--out", ckpt, "--dtype", "fp32", "--verify") == 0, name
        assert max_abs_diff(capsys.readouterr().out) <= 1e-5, name
        assert merge("--ckpt", ckpt, "--out", out, "--max-shard-size", "100KB") == 0, name
        capsys.readouterr()
        assert_bit_exact(hf_tensors(hf_dir), hf_tensors(out))
        index = json.load(open(out / "model.safetensors.index.json"))
        assert len(set(index["weight_map"].values())) > 1, "expected several shards at 100KB"
        assert json.load(open(out / "config.json"))["dtype"] == "float32"
        assert (out / "generation_config.json").is_file()
        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids).logits
            merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        assert torch.equal(reference, merged), name


def test_bf16(tiny_models_dir, tmp_path, capsys):
    """--dtype bf16 stores bf16 and merge --dtype bf16 writes bf16: fp32 source -> exactly
    source.to(bf16); a bf16 source (auto dtype) -> bit-exact. --verify passes in bf16."""
    src = tiny_models_dir / "qwen2"
    assert convert("--hf", src, "--out", tmp_path / "a", "--dtype", "bf16", "--verify") == 0
    assert max_abs_diff(capsys.readouterr().out) <= 2e-2
    assert merge("--ckpt", tmp_path / "a", "--out", tmp_path / "a-hf", "--dtype", "bf16") == 0
    assert_bit_exact({k: v.to(torch.bfloat16) for k, v in hf_tensors(src).items()}, hf_tensors(tmp_path / "a-hf"))
    assert json.load(open(tmp_path / "a-hf" / "config.json"))["dtype"] == "bfloat16"

    bf16_src = tmp_path / "bf16-src"
    make_tiny_hf_model("qwen2_tied").to(torch.bfloat16).save_pretrained(bf16_src)
    assert convert("--hf", bf16_src, "--out", tmp_path / "b", "--no-tokenizer") == 0  # auto -> bf16; weights only
    assert json.load(open(tmp_path / "b" / "rl_meta.json"))["dtype"] == "bfloat16"
    assert merge("--ckpt", tmp_path / "b", "--out", tmp_path / "b-hf") == 0
    assert_bit_exact(hf_tensors(bf16_src), hf_tensors(tmp_path / "b-hf"))


def test_merge_dtype_follows_the_source(tiny_models_dir, tmp_path, capsys):
    """merge's default --dtype is the source model's (its config.json torch_dtype), not the
    checkpoint's: a bf16 model stored in fp32 (as a CPU run trains it) comes back bf16,
    bit-exact; an fp32 model stored in bf16 comes back fp32 (the bf16 values, exactly);
    --dtype overrides; a config without a dtype gives the stored one."""
    bf16_src = tmp_path / "bf16-src"
    make_tiny_hf_model("qwen2").to(torch.bfloat16).save_pretrained(bf16_src)
    assert json.load(open(bf16_src / "config.json"))["dtype"] == "bfloat16"
    assert convert("--hf", bf16_src, "--out", tmp_path / "a", "--dtype", "fp32", "--no-tokenizer") == 0
    assert merge_to_hf.stored_dtype(str(tmp_path / "a")) == torch.float32
    assert merge("--ckpt", tmp_path / "a", "--out", tmp_path / "a-hf") == 0
    assert_bit_exact(hf_tensors(bf16_src), hf_tensors(tmp_path / "a-hf"))
    assert json.load(open(tmp_path / "a-hf" / "config.json"))["dtype"] == "bfloat16"
    assert merge("--ckpt", tmp_path / "a", "--out", tmp_path / "a-fp32", "--dtype", "fp32") == 0
    assert {t.dtype for t in hf_tensors(tmp_path / "a-fp32").values()} == {torch.float32}

    fp32_src = tiny_models_dir / "qwen2"
    assert convert("--hf", fp32_src, "--out", tmp_path / "b", "--dtype", "bf16") == 0
    assert merge("--ckpt", tmp_path / "b", "--out", tmp_path / "b-hf") == 0
    expected = {k: v.to(torch.bfloat16).float() for k, v in hf_tensors(fp32_src).items()}
    assert_bit_exact(expected, hf_tensors(tmp_path / "b-hf"))

    config = json.load(open(tmp_path / "b" / "hf" / "config.json"))  # a source config without a dtype
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    json.dump(config, open(tmp_path / "b" / "hf" / "config.json", "w"))
    assert merge("--ckpt", tmp_path / "b", "--out", tmp_path / "b-stored") == 0
    assert {t.dtype for t in hf_tensors(tmp_path / "b-stored").values()} == {torch.bfloat16}
    capsys.readouterr()


def test_same_checkpoint_as_megatron_save(tiny_models_dir, tmp_path):
    """The streaming converter writes what dist_checkpointing.save of the loaded GPTModel
    writes: same keys, global shapes, dtypes, chunk boundaries and values (qwen3: sharded
    input, q/k norm; qwen2_tied: no output layer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import destroy_distributed, init_distributed
    from common.train.checkpoint import save_model_checkpoint

    def contents(ckpt):
        md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        layout = {
            k: (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
            if hasattr(v, "chunks")
            else "bytes"
            for k, v in md.items()
        }
        tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items() if hasattr(v, "chunks")}
        dcp.load(tensors, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
        return layout, tensors

    for name in ("qwen3", "qwen2_tied"):
        hf_dir = tiny_models_dir / name
        assert convert("--hf", hf_dir, "--out", tmp_path / f"{name}-converted", "--dtype", "fp32") == 0
        init_distributed()
        spec = load_hf_spec(str(hf_dir))
        chunks = build_model(spec)
        load_hf_weights(chunks, spec, str(hf_dir))
        save_model_checkpoint(str(tmp_path / f"{name}-saved"), chunks)
        destroy_distributed()
        layout, tensors = contents(tmp_path / f"{name}-converted")
        expected_layout, expected_tensors = contents(tmp_path / f"{name}-saved")
        assert layout == expected_layout
        assert_bit_exact(expected_tensors, tensors)


def test_merge_training_checkpoint(tiny_models_dir, tmp_path, capsys):
    """merge_to_hf.py reads only the model part of a training checkpoint (model + distributed
    optimizer), given the checkpoints root (`latest`) or a step directory; the HF files come
    from --hf-files or the run directory's hf/."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import destroy_distributed, init_distributed
    from common.train.checkpoint import copy_hf_small_files
    from common.train.save import save_training_checkpoint
    from common.train.setup import setup_training

    hf_dir = tiny_models_dir / "llama"
    init_distributed()
    spec = load_hf_spec(str(hf_dir))
    chunks = build_model(spec)
    load_hf_weights(chunks, spec, str(hf_dir))
    ddp_chunks, optimizer, scheduler = setup_training(chunks, lr=1e-3)
    root = tmp_path / "run" / "checkpoints"
    save_training_checkpoint(str(root), 7, ddp_chunks, optimizer, scheduler)  # no hf/ in the step
    destroy_distributed()
    assert merge("--ckpt", root, "--out", tmp_path / "a") == 2
    assert "cannot find the HF config.json" in capsys.readouterr().out
    assert merge("--ckpt", root / "step_000007", "--out", tmp_path / "a", "--hf-files", hf_dir) == 0
    assert_bit_exact(hf_tensors(hf_dir), hf_tensors(tmp_path / "a"))
    copy_hf_small_files(str(hf_dir), str(tmp_path / "run" / "hf"))
    assert merge("--ckpt", root, "--out", tmp_path / "b") == 0
    assert_bit_exact(hf_tensors(hf_dir), hf_tensors(tmp_path / "b"))


# ---------------------------------------------------------------------------------------
# several processes (torchrun, gloo)
# ---------------------------------------------------------------------------------------
def test_torchrun_convert_verify_tp2_pp2(tiny_models_dir, uneven_models_dir, tmp_path):
    """2-process conversions (each rank writes its own file) verified at TP=2 (qwen3, sharded
    input) and at PP=2 (llama with tied embeddings and 3 layers: uneven stages of 2 + 1 layers),
    then merged in one process, and the llama also at PP=2 with --last-stage-layers 2 (stages of
    1 + 2 layers): bit-exact."""
    for hf_dir, layout in (
        (tiny_models_dir / "qwen3", ["--tp", 2]),
        (uneven_models_dir / "llama_3layers", ["--pp", 2]),
    ):
        ckpt = tmp_path / hf_dir.name
        proc = run_torchrun(
            "convert_hf_to_mcore.py", 2, "--hf", hf_dir, "--out", ckpt, "--dtype", "fp32", "--verify", *layout
        )
        assert max_abs_diff(proc.stdout) <= 1e-5
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt))
        assert merge("--ckpt", ckpt, "--out", tmp_path / f"{hf_dir.name}-hf") == 0
        assert_bit_exact(hf_tensors(hf_dir), hf_tensors(tmp_path / f"{hf_dir.name}-hf"))
    proc = run_torchrun(
        "merge_to_hf.py", 2, "--ckpt", ckpt, "--out", tmp_path / "pp2-hf", "--pp", 2, "--last-stage-layers", 2
    )
    assert "layers per pipeline stage: [1, 2]" in proc.stdout
    assert_bit_exact(hf_tensors(hf_dir), hf_tensors(tmp_path / "pp2-hf"))


# ---------------------------------------------------------------------------------------
# failures: exit 1 for a wrong checkpoint, exit 2 + a message for bad input, no data lost
# ---------------------------------------------------------------------------------------
def test_verify_fails_on_corrupted_checkpoint(tiny_models_dir, tmp_path, capsys, monkeypatch):
    """A converter that writes one wrong tensor (o_proj of layer 1 scaled by 1.01) must fail
    --verify with exit 1, and the output must not get its final name."""
    original = convert_hf_to_mcore.chunk_data

    def corrupted(chunk, files, spec):
        data = original(chunk, files, spec)
        return data * 1.01 if chunk.param == "decoder.layers.1.self_attention.linear_proj.weight" else data

    monkeypatch.setattr(convert_hf_to_mcore, "chunk_data", corrupted)
    out = tmp_path / "bad"
    assert convert("--hf", tiny_models_dir / "qwen2", "--out", out, "--dtype", "fp32", "--verify") == 1
    text = capsys.readouterr().out
    assert max_abs_diff(text) > 1e-4 and "verify FAILED" in text
    assert not out.exists() and (tmp_path / "bad.incomplete").is_dir()


def test_bad_inputs(tiny_models_dir, tmp_path, capsys, monkeypatch):
    """Each bad input: exit 2, a message naming the file/tensor/architecture, no traceback,
    and neither the input nor an existing --out changed."""
    src = tmp_path / "src"
    shutil.copytree(tiny_models_dir / "qwen3", src)  # sharded: model-0000i-of-0000n.safetensors
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("precious")
    before = snapshot(tiny_models_dir, busy)

    def expect_error(run, *args, says):
        assert run(*args) == 2
        text = capsys.readouterr().out
        for part in says:
            assert part in text, (part, text)
        assert snapshot(tiny_models_dir, busy) == before

    # --out not empty (without --force; and with --force when it is not an earlier output)
    expect_error(convert, "--hf", src, "--out", busy, says=["not empty", "--force"])
    expect_error(convert, "--hf", src, "--out", busy, "--force", says=["does not look like"])
    expect_error(merge, "--ckpt", tiny_models_dir / "qwen2", "--out", tmp_path / "x", says=["is not a checkpoint"])
    expect_error(convert, "--hf", src, "--out", src, "--force", says=["is (or contains) the input"])
    expect_error(
        convert,
        "--hf",
        src,
        "--out",
        tmp_path / "o",
        "--verify",
        "--pp",
        2,
        "--first-stage-layers",
        4,
        says=["--verify layout: num_hidden_layers=4 cannot be split over --pp 2 with --first-stage-layers 4"],
    )

    # a truncated shard, then a missing shard: the file is named
    victim = src / shards[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 10)
    expect_error(convert, "--hf", src, "--out", tmp_path / "o", says=[str(victim), "truncated"])
    os.remove(victim)
    expect_error(convert, "--hf", src, "--out", tmp_path / "o", says=[str(victim), "missing"])
    shutil.rmtree(src)
    shutil.copytree(tiny_models_dir / "qwen3", src)

    # config.json inconsistent with the weights: the tensor and both shapes are named
    config = json.load(open(src / "config.json"))
    json.dump(dict(config, intermediate_size=128), open(src / "config.json", "w"))
    expect_error(
        convert,
        "--hf",
        src,
        "--out",
        tmp_path / "o",
        says=["model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]"],
    )
    # unsupported architecture: named, and the supported ones listed
    json.dump(dict(config, architectures=["GPT2LMHeadModel"]), open(src / "config.json", "w"))
    expect_error(convert, "--hf", src, "--out", tmp_path / "o", says=["GPT2LMHeadModel", "Qwen2ForCausalLM"])
    json.dump(config, open(src / "config.json", "w"))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.incomplete").exists()

    # disk full (the kernel's ENOSPC from /dev/full): partial output removed, message says so
    def full_disk(module, suffix):
        def fake_open(path, mode="r", *args, **kwargs):
            if "w" in mode and str(path).endswith(suffix):
                path = "/dev/full"
            return open(path, mode, *args, **kwargs)

        monkeypatch.setattr(module, "open", fake_open, raising=False)

    from common.run import convert_io  # the converter's writer lives there

    full_disk(convert_io, ".distcp")
    expect_error(convert, "--hf", src, "--out", tmp_path / "o", says=["disk full"])
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.incomplete").exists()
    monkeypatch.undo()
    assert convert("--hf", src, "--out", tmp_path / "ckpt", "--dtype", "fp32") == 0
    full_disk(merge_to_hf, ".safetensors")
    expect_error(merge, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "o", says=["disk full"])
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.incomplete").exists()
    monkeypatch.undo()

    # --force replaces an earlier output of the same script, only once the new one is complete
    capsys.readouterr()
    assert convert("--hf", tiny_models_dir / "llama", "--out", tmp_path / "ckpt", "--dtype", "fp32") == 2
    assert convert("--hf", tiny_models_dir / "llama", "--out", tmp_path / "ckpt", "--force") == 0
    assert json.load(open(tmp_path / "ckpt" / "rl_meta.json"))["architecture"] == "LlamaForCausalLM"

    # the real script in a subprocess: exit code 2 and no traceback
    with open(src / shards[0], "r+b") as f:
        f.truncate(100)
    proc = run_script("convert_hf_to_mcore.py", "--hf", src, "--out", tmp_path / "o", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(src / shards[0]) in proc.stdout


def test_ctrl_c_exits_130_with_one_line(tiny_models_dir, tmp_path, capsys, monkeypatch):
    """A SIGINT delivered as a write of the converter returns (Ctrl-C mid-file): exit 130, the
    one line, the partial output removed, as merge_to_hf.py. The interrupt lands inside
    torch.save's zip writer, which turns it into a RuntimeError ("unexpected pos") as the file
    closes: without the recorded signal this was a traceback and exit 1."""
    import io
    import signal

    from common.run import convert_io

    class InterruptedFile(io.FileIO):
        def write(self, data):
            written = super().write(data)
            if self.tell() > 2000:
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs as this write returns
            return written

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".distcp"):
            return io.BufferedWriter(InterruptedFile(path, "w"))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(convert_io, "open", fake_open, raising=False)
    handler = signal.getsignal(signal.SIGINT)
    assert convert("--hf", tiny_models_dir / "qwen2", "--out", tmp_path / "o") == 130
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"error: interrupted; the partial output {tmp_path / 'o'}.incomplete was removed."
    )
    assert os.listdir(tmp_path) == [] and signal.getsignal(signal.SIGINT) is handler  # handler restored


def test_no_known_warnings_printed(tiny_models_dir, tmp_path):
    """convert then merge in a fresh process (megatron's notices fire at its import and as a
    checkpoint loads), without the test suite's PYTHONWARNINGS=ignore: the only warning printed
    is one of this test's own, so the known harmless ones (common/run/console.py) are silenced and
    any other warning still shows."""
    code = (
        "import sys, warnings\n"
        "import convert_hf_to_mcore, merge_to_hf\n"
        "hf, ckpt, out = sys.argv[1:]\n"
        "assert convert_hf_to_mcore.main(['--hf', hf, '--out', ckpt]) == 0\n"
        "assert merge_to_hf.main(['--ckpt', ckpt, '--out', out]) == 0\n"
        "warnings.warn('a warning of its own')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny_models_dir / "qwen2"), str(tmp_path / "ckpt"), str(tmp_path / "hf")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stderr.splitlines() if "Warning: " in line]
    assert printed and all("a warning of its own" in line for line in printed), printed


@pytest.mark.parametrize("tool", [convert_hf_to_mcore, merge_to_hf])
def test_help_documents_every_flag(tool, monkeypatch):
    """Every flag of the two conversion tools has a help string (the parser each builds, caught as it parses)."""
    from common.run import cli

    class Caught(Exception):
        pass

    def catch(parser, *args, **kwargs):
        raise Caught(parser)

    monkeypatch.setattr(cli.Parser, "parse_args", catch)
    with pytest.raises(Caught) as caught:
        tool.parse_args([])
    parser = caught.value.args[0]
    assert_every_flag_documented(parser)
    assert len(parser._actions) > 5  # the whole parser, not an empty one
