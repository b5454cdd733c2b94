"""On-policy distillation (--teacher): the advantage and loss by hand, the teacher's vocabulary checks,
the teacher's logprobs against transformers, and a student that learns the task from the teacher alone.

    .venv/bin/python -m pytest -q tests/test_distill.py

- common/rl/distill.py: per-token advantages coef x (teacher - student) on response tokens only, and the
  clipped policy loss they give, against numbers worked out by hand;
- preflight (through train_grpo.py / train_ppo.py): a teacher with another tokenizer is refused in one line
  that gives both sizes; one whose embedding rows are padded further is accepted (a step runs); one with
  fewer rows than the tokenizer's ids is refused;
- the memory plan: the teacher's weights by hand (host buffers, the logprob phase); --dry-run prints them;
- through train_grpo.py, one on-policy step with --distill-coef 2 and no task reward: distill_reverse_kl is
  the mean student - teacher logprob that transformers computes for the saved samples, and the policy loss
  is 2 x that (ratio 1: loss = -mean advantage); the same identity through train_ppo.py;
- --distill-topk: the teacher's top-k, the student's logprobs at its ids (values, gradient) and the forward KL
  by hand; one step of each script against transformers (policy loss = coef x distill_topk_kl), GRPO's at
  TP=2 equal to TP=1; without --teacher or below 0, refused;
- prompts without answers (--answer-key none) are distilled with --rule-reward-weight 0, refused without it;
- an embedded student with --rule-reward-weight 0 learns the embedded task from an embedded teacher (twice
  as wide, trained on the task): the task reward, measured and not optimised, rises.
"""

import json
import os
import shutil

import pytest
import torch

from tests.conftest import read_metrics, run_script, run_torchrun

SMALL = ["--prompts-per-step", 8, "--samples-per-prompt", 4, "--max-new-tokens", 1, "--eval-every", 0]


# ---- the math -------------------------------------------------------------------------------


def test_distill_advantages_and_loss_by_hand():
    from common.rl.distill import distill_advantages, reverse_kl_sum
    from common.rl.losses import aggregate_loss, policy_loss

    teacher = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-3.0, -0.1, -float("inf"), 0.0]])
    student = torch.tensor([[-2.0, -1.5, -1.0, 0.0], [-1.0, -0.1, -5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # padding may hold -inf
    adv = distill_advantages(teacher, student, mask, coef=0.5)
    # 0.5 x (teacher - student): (1, 1, -1) and (-2, 0); 0 off the mask
    assert torch.equal(adv, torch.tensor([[0.5, 0.5, -0.5, 0.0], [-1.0, 0.0, 0.0, 0.0]]))
    # student - teacher summed over the 5 tokens: -1 - 1 + 1 + 2 + 0 = 1 (per token 0.2)
    assert reverse_kl_sum(teacher, student, mask).item() == pytest.approx(1.0)
    # the update's logprobs: token (0, 0) up by log 1.5 (ratio 1.5 > 1.2: clipped, A > 0), token (1, 0)
    # down to ratio 0.5 (A < 0: the unclipped ratio x A is the smaller objective), the rest unchanged
    new = student.clone()
    new[0, 0] += torch.log(torch.tensor(1.5))
    new[1, 0] += torch.log(torch.tensor(0.5))
    per_token, clipped = policy_loss(new, student, adv, 0.2, 0.2)
    # -min(r A, clip(r) A): (0, 0): -1.2 x 0.5 = -0.6; (0, 1): -0.5; (0, 2): +0.5;
    # (1, 0): r 0.5, A -1: min(-0.5, -0.8) = -0.8 -> +0.8; (1, 1): 0
    expected = (-0.6 - 0.5 + 0.5 + 0.8 + 0.0) / 5
    loss = aggregate_loss(per_token, mask, "token_mean", num_tokens=mask.sum())
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert clipped[0, 0] and clipped[1, 0] and not clipped[0, 1]


def test_topk_by_hand():
    """--distill-topk's math: the teacher's top-k without the vocabulary padding, the student's logprobs at
    its ids from the sampled token's (values and gradient as log_softmax's), the forward KL to the
    renormalised top-k."""
    import math

    from common.rl.distill import topk_forward_kl, topk_student_logprobs, vocab_parallel_topk

    logits = torch.tensor([[[2.0, 0.0, 1.0, 0.0, 9.0]]])  # (1, 1, 5): column 4 is padding (vocab_size 4)
    values, ids = vocab_parallel_topk(logits, 2, vocab_size=4)
    log_z = math.log(math.e**2 + 1 + math.e + 1)
    assert ids.tolist() == [[[0, 2]]] and values[0, 0].tolist() == pytest.approx([2 - log_z, 1 - log_z])
    values, ids = vocab_parallel_topk(logits, 1, vocab_size=4, temperature=0.5)  # logits / 0.5
    assert ids.tolist() == [[[0]]] and values.item() == pytest.approx(4 - math.log(math.e**4 + 2 + math.e**2))

    # seeded: the columns are gathered in fp32 (as for bf16 logits), and ~9% of unseeded draws put the two
    # gradients 3e-7 apart, past allclose's default tolerance for these float64 inputs
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets, ids = torch.randint(0, 7, (2, 3)), torch.randint(0, 7, (2, 3, 4))
    full = torch.log_softmax(x / 0.7, dim=-1)
    ours = topk_student_logprobs(x, ids, targets, full.gather(-1, targets[..., None])[..., 0], temperature=0.7)
    assert torch.allclose(ours, full.gather(-1, ids))
    (grad,) = torch.autograd.grad((ours * torch.arange(4.0)).sum(), x, retain_graph=True)
    (expected,) = torch.autograd.grad((full.gather(-1, ids) * torch.arange(4.0)).sum(), x)
    assert torch.allclose(grad, expected)

    # teacher top-2 probabilities 0.6, 0.2 -> renormalised 0.75, 0.25; the student's 0.5, 0.25 there:
    # 0.75 log(0.75 / 0.5) + 0.25 log(0.25 / 0.25); a student equal to the renormalised teacher: 0
    teacher = torch.tensor([[[math.log(0.6), math.log(0.2)]]])
    assert topk_forward_kl(teacher, torch.tensor([[[math.log(0.5), math.log(0.25)]]])).item() == pytest.approx(
        0.75 * math.log(1.5)
    )
    assert topk_forward_kl(teacher, torch.tensor([[[math.log(0.75), math.log(0.25)]]])).item() == pytest.approx(
        0, abs=1e-6
    )


# ---- teachers -------------------------------------------------------------------------------


def sft_teacher(path, right=1.0, steps=150):
    """An embedded model twice as wide as the student's, trained (cross-entropy, in transformers, ~4 s) to
    answer the embedded task "d=" -> "d" with p(right digit) -> `right`, the rest spread over the other
    digits. A GRPO run and merge_to_hf.py give the same kind of teacher at ~15x the cost. (A teacher whose
    mistakes are digits, right < 1, leads the student to a plateau first: any digit, whatever the prompt,
    where the sampled-token estimator without a baseline is slow to leave; a sharp teacher is not.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.run.embedded import write_embedded_model

    write_embedded_model(path, seed=1, hidden_size=128, intermediate_size=256)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    digits = [str(d) for d in range(10)]
    inputs = torch.tensor([tok.encode(f"{d}=", add_special_tokens=False) for d in digits])  # (10, 2)
    digit_ids = torch.tensor([tok.encode(d, add_special_tokens=False)[0] for d in digits])
    target = torch.zeros(10, model.config.vocab_size)
    target[:, digit_ids] = (1 - right) / 9
    target[torch.arange(10), digit_ids] = right
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.train()
        for _ in range(steps):
            loss = -(target * model(inputs).logits[:, -1].log_softmax(-1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        p_right = model(inputs).logits[:, -1].softmax(-1)[torch.arange(10), digit_ids]
    assert (p_right - right).abs().max() < 0.01, p_right  # trained as meant
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return sft_teacher(str(tmp_path_factory.mktemp("teacher") / "hf"))


def embedded_dir(path, **config):
    from common.run.embedded import write_embedded_model

    write_embedded_model(str(path), **config)
    return str(path)


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_teacher_with_another_tokenizer_is_refused(script, tmp_path):
    path = embedded_dir(tmp_path / "other")
    with open(os.path.join(path, "tokenizer.json")) as f:
        tok = json.load(f)
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 259, "content": "<|extra|>"})
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    proc = run_script(script, "--teacher", path, "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"--teacher {path}: its tokenizer has 260 tokens, the policy's 259" in last, last


def test_teacher_vocabulary_rows(tmp_path):
    """Padded further (384 embedding rows for the 259 tokens, twice as wide): accepted, and a step runs with
    its logprobs over its own rows; fewer rows than token ids: refused."""
    padded = embedded_dir(tmp_path / "padded", vocab_size=384, hidden_size=128)
    out = tmp_path / "out"
    run_script("train_grpo.py", *SMALL, "--steps", 1, "--teacher", padded, "--out", out)
    (m,) = read_metrics(out)
    assert m["distill_reverse_kl"] == pytest.approx(m["distill_reverse_kl"]) and m["teacher_s"] > 0  # finite
    short = embedded_dir(tmp_path / "short")
    with open(os.path.join(short, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(short, "config.json"), "w") as f:
        json.dump(dict(config, vocab_size=200), f)
    proc = run_script("train_grpo.py", "--teacher", short, "--out", tmp_path / "out2", check=False)
    assert proc.returncode == 2
    assert "the teacher has 200 embedding rows" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


# a teacher of 1,444,096 parameters by hand: tied embeddings 1024 x 256; per layer q 256x256 + 256 (bias),
# k and v 256x128 + 128 each, o 256x256, the MLP 3 x 256x512, two norms of 256; the final norm 256
TEACHER = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
TEACHER_PARAMS = 1024 * 256 + 2 * (256 * 256 + 256 + 2 * (256 * 128 + 128) + 256 * 256 + 3 * 256 * 512 + 2 * 256) + 256


def test_memory_plan_counts_the_teacher():
    """On a GPU with the parameters offloaded: the teacher's bf16 weights are pinned in host memory and on
    the GPU in the logprob phase, where the frozen models take turns (the larger, the teacher, counts)."""
    from common.model.bridge import parse_hf_config
    from common.run import memory_plan as M
    from common.run.embedded import DEFAULT_CONFIG, hf_config

    policy, teacher = parse_hf_config(hf_config(DEFAULT_CONFIG)), parse_hf_config(TEACHER)
    kw = dict(world=1, reference=True, gpu_bytes=80e9, offload_params=True, offload_optimizer=True)
    with_teacher, without = M.plan_memory(policy, teacher=teacher, **kw), M.plan_memory(policy, **kw)
    host = with_teacher.host_parts()["offload buffers"] - without.host_parts()["offload buffers"]
    assert host == 2 * TEACHER_PARAMS
    items = {i.name: i for i in with_teacher.shown.items}
    assert items["teacher weights (bf16)"].device == {"logprob": 2 * TEACHER_PARAMS}
    assert "logprob" not in items["reference weights (bf16)"].device  # (the smaller frozen model)


def test_dry_run_plans_the_teacher(tmp_path):
    """--dry-run with a Qwen2-7B teacher (config.json alone) for the embedded policy: its weights in the
    logprob phase, 15.2 GB in bf16 (7.62e9 parameters x 2 bytes)."""
    path = tmp_path / "teacher"
    path.mkdir()
    qwen2_7b = dict(TEACHER, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
    qwen2_7b.update(num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(qwen2_7b))
    proc = run_script("train_grpo.py", "--teacher", path, "--dry-run", "--gpu-memory-gb", 80, "--out", tmp_path / "o")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("teacher weights (bf16)"))
    assert row.split()[-4:] == ["15.2", "-", "-", "15.2"], row  # logprob (GPU), update, save, pinned host
    assert "logits (384 vocabulary columns, the teacher's 152064)" in proc.stdout
    assert not (tmp_path / "o").exists()


def hf_logprobs(model_dir, samples):
    """log p(response token) of each saved sample (one response token each) under an HF model, (N,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1]  # predicts the first response token
            out.append(logits.log_softmax(-1)[s.response_ids[0]])
    return torch.stack(out)


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_one_step_matches_transformers(script, teacher, tmp_path):
    """One step, one mini-batch, no task reward, --distill-coef 2: the reverse KL is transformers' mean
    student - teacher logprob of the saved samples; the policy loss is 2 x that (the ratio is 1 at the
    step's one update: loss = -mean advantage)."""
    out = tmp_path / "run"
    run_script(
        script,
        *SMALL,
        *("--steps", 1, "--teacher", teacher, "--distill-coef", 2, "--rule-reward-weight", 0),
        *("--kl-coef", 0, "--entropy-coef", 0, "--mini-batch-size", 32, "--temperature", 1.0),
        *("--out", out, "--save-rollouts", tmp_path / "rollouts"),
    )
    (m,) = read_metrics(out)
    samples = torch.load(tmp_path / "rollouts" / "step_000000.pt", weights_only=False)["samples"]
    student = hf_logprobs(out / "embedded_model", samples)
    expected = (student - hf_logprobs(teacher, samples)).mean().item()
    assert m["distill_reverse_kl"] == pytest.approx(expected, abs=2e-3), (m["distill_reverse_kl"], expected)
    assert m["policy_loss"] == pytest.approx(2 * m["distill_reverse_kl"], rel=1e-3, abs=1e-3)
    assert m["teacher_s"] > 0 and m["reward_mean"] == 0.0


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_topk_step_matches_transformers_at_tp1_and_tp2(script, teacher, tmp_path):
    """--distill-topk 3, one step, no task reward (advantages 0), --distill-coef 2: the policy loss is
    2 x distill_topk_kl, and that is the forward KL from the teacher's top 3 (transformers' logits,
    renormalised) to the student's distribution, by hand. GRPO's step at TP=2 (the teacher's top 3 over
    two vocabulary shards; the student's logprobs gathered across them) gives the same numbers."""
    flags = [*SMALL, "--steps", 1, "--teacher", teacher, "--distill-coef", 2, "--rule-reward-weight", 0]
    flags += ["--kl-coef", 0, "--entropy-coef", 0, "--mini-batch-size", 32, "--distill-topk", 3]
    run_script(script, *flags, "--out", tmp_path / "tp1", "--save-rollouts", tmp_path / "rollouts")
    (m,) = read_metrics(tmp_path / "tp1")
    samples = torch.load(tmp_path / "rollouts" / "step_000000.pt", weights_only=False)["samples"]
    from transformers import AutoModelForCausalLM

    kls = []
    student, teach = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for d in (tmp_path / "tp1" / "embedded_model", teacher)
    )
    with torch.no_grad():
        for s in samples:  # one response token each: the position before it
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            q, p = (model(ids).logits[0, len(s.prompt_ids) - 1].log_softmax(-1) for model in (student, teach))
            top = p.topk(3)
            renormalised = top.values.softmax(-1)
            kls.append((renormalised * (renormalised.log() - q[top.indices])).sum())
    expected = torch.stack(kls).mean().item()
    assert m["distill_topk_kl"] == pytest.approx(expected, rel=1e-3), (m["distill_topk_kl"], expected)
    assert m["policy_loss"] == pytest.approx(2 * expected, rel=1e-3) and m["reward_mean"] == 0.0
    if script == "train_ppo.py":
        return
    run_torchrun(script, 2, *flags, "--tp", 2, "--load-rollouts", tmp_path / "rollouts", "--out", tmp_path / "tp2")
    (tp2,) = read_metrics(tmp_path / "tp2")
    for key in ("distill_topk_kl", "distill_reverse_kl", "policy_loss", "grad_norm"):
        assert tp2[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), (key, tp2[key], m[key])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distill-topk", 3], "--distill-topk 3 distils a teacher's top-K tokens: give --teacher"),
        (["--distill-topk", -1, "--teacher", "."], "--distill-topk -1: give 0 (the sampled token) or K"),
    ],
)
def test_bad_distill_topk_is_refused(flags, message, tmp_path):
    proc = run_script("train_grpo.py", *flags, "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_prompts_without_answers(teacher, tmp_path):
    """--answer-key none: prompts alone, distilled with --rule-reward-weight 0; refused with a rule reward."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}="}) + "\n" for d in range(10)))
    flags = [*SMALL, "--steps", 1, "--data", data, "--answer-key", "none", "--teacher", teacher]
    proc = run_script("train_grpo.py", *flags, "--out", tmp_path / "refused", check=False)
    assert proc.returncode == 2
    assert "--answer-key none: the prompts have no reference answers" in proc.stderr.strip().splitlines()[-1]
    run_script("train_grpo.py", *flags, "--rule-reward-weight", 0, "--out", tmp_path / "run")
    (m,) = read_metrics(tmp_path / "run")
    assert m["reward_mean"] == 0.0 and m["distill_reverse_kl"] > 0 and m["teacher_s"] > 0


def test_student_learns_from_the_teacher_alone(teacher, tmp_path):
    """No task reward (--rule-reward-weight 0): the embedded student's rule reward, logged as
    rule_reward_mean, rises from chance as it matches the teacher."""
    out = tmp_path / "run"
    # measured: rule reward 0.004 -> 0.27, reverse KL 11.3 -> 7.5 (means of the first and last 5 steps)
    run_script("train_grpo.py", "--steps", 60, "--teacher", teacher, "--rule-reward-weight", 0, "--out", out)
    metrics = read_metrics(out)
    assert all(m["reward_mean"] == 0.0 for m in metrics)  # nothing but the teacher to learn from
    mean = lambda key, ms: sum(m[key] for m in ms) / len(ms)  # noqa: E731
    first, last = mean("rule_reward_mean", metrics[:5]), mean("rule_reward_mean", metrics[-5:])
    rkl_first, rkl_last = mean("distill_reverse_kl", metrics[:5]), mean("distill_reverse_kl", metrics[-5:])
    print(f"rule reward {first:.3f} -> {last:.3f}, reverse KL {rkl_first:.2f} -> {rkl_last:.2f}")
    assert last >= first + 0.15 and rkl_last < rkl_first - 2
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
