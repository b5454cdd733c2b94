"""common/model/lora.py: LoRA adapters on megatron's tensor-parallel linears (worker: tests/lora_worker.py).

.venv/bin/python -m pytest -x -q tests/test_lora.py
"""

import json
import shutil

import pytest
import torch

from common.model import lora
from common.model import sizes as S
from common.model.gpt import load_hf_spec
from tests.conftest import read_metrics, run_script, run_scripts, run_torchrun


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tests.tiny_models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("lora") / "qwen2"
    save_tiny_hf_model("qwen2", str(path))
    return path


# r x (in + out) per adapted linear of tests/tiny_models.py's qwen2 at r = 4, by hand: qkv 4 x (64 + 128),
# proj 4 x (64 + 64), fc1 4 x (64 + 192), fc2 4 x (96 + 64): 2944 per layer, 4 layers
ADAPTERS = 4 * 2944


def test_b0_is_the_base_and_gradients_are_the_chain_rule(qwen2_dir, tmp_path):
    """B = 0: the logits equal the base model's bit for bit (and with the adapters disabled, too); the
    adapters' gradients equal autograd through an explicit fp32 W + s B A (dB = s dW A^T, dA = s B^T dW);
    only adapters train; with bf16 weights the optimizer holds fp32 grads, main params and two moments
    of the adapters alone: 16 bytes per adapter parameter, nothing for the frozen base."""
    out = tmp_path / "r.json"
    run_torchrun("tests/lora_worker.py", 1, qwen2_dir, "--mode", "grads", "--out", out)
    r = json.loads(out.read_text())
    print(r)
    assert r["adapted"] == 16  # qkv, proj, fc1, fc2 of 4 layers
    assert r["b0_equal"] and r["disabled_equal"] and r["trainable_only_adapters"]
    assert r["vocab_bmm"] == 0  # the frozen output layer's backward on one row: a GEMM, not a bmm per token
    assert r["grad_tensors"] == 32 and r["grad_max_rel_err"] < 1e-5
    assert r["merged_logits_err"] < 1e-5
    n = ADAPTERS
    assert r["adapter_numel"] == n  # and the memory plan's count (common/model/sizes.py)
    spec = load_hf_spec(qwen2_dir)
    assert S.count_lora_parameters(spec, range(4), rank=4, targets=("attention", "mlp")) == n
    assert r["lora"] == dict(grad=4 * n, main=4 * n, moments=8 * n)  # no padding at this size
    assert r["full"]["main"] == 4 * r["model_numel"] and r["full"]["moments"] == 8 * r["model_numel"]
    assert r["full"]["grad"] >= 4 * r["model_numel"]  # (megatron pads its buffer)


def test_tp2_equals_tp1(qwen2_dir, tmp_path):
    """Two Adam steps on the adapters at TP=1 (DP=2), TP=2 and TP=2 with sequence parallelism: the same
    gradient norms, logits and merged export (fp32 rounding apart); B = 0 is the base at each layout."""
    layouts = {"tp1": [], "tp2": ["--tp", "2"], "tp2sp": ["--tp", "2", "--sp"]}
    out = tmp_path / "r.json"
    run_torchrun("tests/lora_worker.py", 2, qwen2_dir, "--layouts", json.dumps(layouts), "--out", out)
    r = json.loads(out.read_text())
    saved = {name: torch.load(tmp_path / f"tp{2 if 'tp2' in name else 1}-sp{name == 'tp2sp'}.pt") for name in layouts}
    one = saved["tp1"]
    assert (one["after"] - one["base"]).abs().max() > 0.1  # the steps changed the model
    for name in layouts:
        print(name, r[name])
        assert r[name]["b0_equal"]
        assert r[name]["grad_norms"] == pytest.approx(r["tp1"]["grad_norms"], rel=1e-5)
        assert (saved[name]["after"] - one["after"]).abs().max() < 1e-5
        assert saved[name]["exported"].keys() == one["exported"].keys()
        for key, tensor in one["exported"].items():
            assert (saved[name]["exported"][key] - tensor).abs().max() < 1e-5, key


def test_targets_are_checked():
    assert lora.parse_targets("attention, mlp") == ("attention", "mlp")
    assert lora.parse_targets("mlp") == ("mlp",)
    with pytest.raises(ValueError, match="comma-separated subset"):
        lora.parse_targets("attn")
    with pytest.raises(ValueError, match="routed experts"):
        lora.parse_targets("attention,experts")
    assert lora.is_adapter("decoder.layers.0.mlp.linear_fc1.lora_a") and not lora.is_adapter("x.weight")


SMALL = ["--prompts-per-step", 8, "--samples-per-prompt", 4, "--micro-batch-size", 4, "--mini-batch-size", 16]
LORA = ["--lora-rank", 8, "--lr", 1e-2, "--max-new-tokens", 4]


def test_grpo_resume_is_exact_and_the_engine_gets_merged_weights(tmp_path):
    """train_grpo.py --lora-rank: 4 steps in one go equal 2 steps + --resume to 4 (the checkpoint holds the
    adapters, their optimizer state and the base's name), and so does a resume at TP=2 under torchrun (the
    same rollouts replayed): the adapters' checkpoint reshards (B of fc1 split into gate and up as megatron
    splits W). After each update the CPU engine samples with the merged weights: its logprobs equal the
    trainer's (logprob_mismatch ~ 0, while the policy left the base: kl > 0)."""
    straight, resumed, tp2 = tmp_path / "straight", tmp_path / "resumed", tmp_path / "tp2"
    run_scripts(
        ("train_grpo.py", *SMALL, *LORA, "--steps", 4, "--out", straight, "--save-rollouts", tmp_path / "rollouts"),
        ("train_grpo.py", *SMALL, *LORA, "--steps", 2, "--out", resumed),
    )
    shutil.copytree(resumed, tp2)
    run_script("train_grpo.py", *SMALL, *LORA, "--steps", 4, "--out", resumed, "--resume")
    resume_tp2 = ["--steps", 4, "--tp", 2, "--out", tp2, "--resume", "--load-rollouts", tmp_path / "rollouts"]
    run_torchrun("train_grpo.py", 2, *SMALL, *LORA, *resume_tp2)
    straight_m, resumed_m, tp2_m = read_metrics(straight), read_metrics(resumed), read_metrics(tp2)
    assert [m["step"] for m in resumed_m] == [m["step"] for m in tp2_m] == [0, 1, 2, 3]
    for a, b, c in zip(straight_m, resumed_m, tp2_m, strict=True):
        for key in ("policy_loss", "grad_norm", "kl", "entropy", "reward_mean", "logprob_mismatch"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
        for key in ("policy_loss", "grad_norm", "kl", "entropy", "reward_mean"):
            assert a[key] == pytest.approx(c[key], rel=1e-4, abs=1e-5), ("tp2", a["step"], key)
    assert straight_m[-1]["kl"] > 1e-4  # the policy left the base (the reference: the adapters off)
    assert max(m["logprob_mismatch"] for m in straight_m) < 1e-5
    # resuming with other LoRA flags (or none) is refused in one line, before anything is built
    proc = run_script("train_grpo.py", *SMALL, "--steps", 5, "--out", resumed, "--resume", check=False)
    assert (
        proc.returncode == 2
        and "written with --lora-rank 8 --lora-alpha 16 --lora-targets attention,mlp" in proc.stderr
    )
    meta = json.loads((straight / "checkpoints" / "step_000004" / "rl_meta.json").read_text())
    assert meta["lora"] == dict(
        rank=8, alpha=16.0, targets=["attention", "mlp"], base=str(straight / "embedded_model"), base_mcore=None
    )


@pytest.fixture(scope="module")
def learnable_base(tmp_path_factory):
    """The embedded tiny model with its final norm's weight x 6, and a reward for answering with a digit.

    Why not the embedded model as it is: its LM head (tied, random, std 0.02) is frozen under LoRA and bounds
    every logit gap to ~1.3, so no adapter can make a token likely (measured: supervised, a rank-16 LoRA
    saturates at p = 0.17 for the right digit; full fine-tuning reaches 0.9996). x 6 lets the adapters
    reach p(digit) = 0.96 (supervised, rank 8) while the base writes a digit 3% of the time."""
    from safetensors.torch import load_file, save_file

    from common.run.embedded import write_embedded_model

    root = tmp_path_factory.mktemp("lora_base")
    base = write_embedded_model(str(root / "base"))
    tensors = load_file(f"{base}/model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 6
    save_file(tensors, f"{base}/model.safetensors", metadata={"format": "pt"})
    (root / "reward.py").write_text(
        "from common.rl.rewards import synthetic_reward\n\n\n"
        "def any_digit(response, answer):  # 1 for a response that starts with a number\n"
        "    return synthetic_reward(response, answer, format_credit=1.0)\n"
    )
    return root


def test_grpo_with_lora_learns_and_merges(learnable_base, tmp_path):
    """train_grpo.py --lora-rank 8 on a frozen base: the reward rises (measured 0.03 -> 0.93 in 4 steps);
    merge_to_hf.py writes the merged model (every adapted HF weight equals W + s B A of the PEFT export's
    factors, bit for bit; every other tensor is the base's) and a PEFT adapter directory in PEFT's layout."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    base = learnable_base / "base"
    flags = ["--max-new-tokens", 1, "--mini-batch-size", 64, "--eval-every", 0, "--lr", 1e-2]
    reward = f"{learnable_base / 'reward.py'}:any_digit"
    lora_flags = ["--lora-rank", 8, "--lora-alpha", 32]  # scale 4
    run_script("train_grpo.py", "--model", base, *lora_flags, *flags, "--steps", 6, "--reward", reward, "--out", out)
    rewards = [m["reward_mean"] for m in read_metrics(out)]
    print("rewards", rewards)
    assert rewards[0] < 0.1 and min(rewards[-2:]) > 0.5
    ckpt = out / "checkpoints" / "step_000006"
    run_scripts(
        ("merge_to_hf.py", "--ckpt", ckpt, "--out", tmp_path / "merged"),
        ("merge_to_hf.py", "--ckpt", ckpt, "--out", tmp_path / "peft", "--lora", "peft"),
    )
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 32.0
    assert config["base_model_name_or_path"] == str(base)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    factors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    weights = load_file(base / "model.safetensors")
    merged = {}
    for shard in (tmp_path / "merged").glob("model-*.safetensors"):
        merged.update(load_file(shard))
    assert merged.keys() == weights.keys()
    adapted = 0
    for name, w in weights.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" not in factors:
            assert torch.equal(merged[name], w), name
            continue
        a, b = factors[f"{prefix}.lora_A.weight"], factors[f"{prefix}.lora_B.weight"]
        assert a.shape == (8, w.shape[1]) and b.shape == (w.shape[0], 8)
        assert torch.equal(merged[name], (w.float() + 4.0 * (b.float() @ a.float())).to(w.dtype)), name
        adapted += 1
    assert adapted == 2 * 7 == len(factors) // 2  # 2 layers x q, k, v, o, gate, up, down


def test_ppo_with_lora_trains_the_actor_adapters(tmp_path):
    """train_ppo.py --lora-rank --lora-targets mlp: the actor's checkpoint holds its MLPs' adapters (and their
    Adam state) alone, the critic's its whole model; the actor leaves the base (kl != 0, the reference being
    the adapters off) and the CPU engine samples with the merged weights (logprob_mismatch ~ 0)."""
    from torch.distributed.checkpoint import FileSystemReader

    small = [*SMALL, "--max-new-tokens", 4, "--critic-warmup-steps", 1]
    lora_flags = ["--lora-rank", 8, "--lora-alpha", 4, "--lora-targets", "mlp"]
    run_script("train_ppo.py", *small, *lora_flags, "--lr", 1e-2, "--steps", 3, "--out", tmp_path)
    steps = read_metrics(tmp_path)
    assert abs(steps[-1]["kl"]) > 1e-4 and max(m["logprob_mismatch"] for m in steps) < 1e-5  # (k1: either sign)
    ckpt = tmp_path / "checkpoints" / "step_000003"
    actor = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    critic = FileSystemReader(ckpt / "critic").read_metadata().state_dict_metadata
    model_keys = [k for k in actor if not k.startswith("optimizer.")]
    assert model_keys and all(lora.is_adapter(k) for k in model_keys), model_keys[:5]
    assert sorted(model_keys) == [
        f"decoder.layers.mlp.{fc}.{f}" for fc in ("linear_fc1", "linear_fc2") for f in ("lora_a", "lora_b")
    ]
    assert "embedding.word_embeddings.weight" in critic
    lora_meta = json.loads((ckpt / "rl_meta.json").read_text())["lora"]
    assert (lora_meta["rank"], lora_meta["alpha"], lora_meta["targets"]) == (8, 4.0, ["mlp"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", -1], "--lora-rank must be >= 0"),
        (["--lora-alpha", 8], "--lora-alpha needs --lora-rank"),
        (["--lora-rank", 4, "--lora-alpha", 0], "--lora-alpha must be > 0"),
        (["--lora-rank", 4, "--lora-targets", "attn"], "--lora-targets 'attn': choose a comma-separated subset"),
        (["--lora-rank", 4, "--lora-targets", "experts"], "routed experts (grouped GEMMs) are not supported"),
        (["--lora-rank", 4, "--eval-only"], "merge the LoRA checkpoint first"),
    ],
)
def test_bad_lora_flags_are_refused_in_one_line(flags, message, tmp_path):
    proc = run_script("train_grpo.py", *flags, "--out", tmp_path, check=False)
    print(proc.stderr[-500:])
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr
