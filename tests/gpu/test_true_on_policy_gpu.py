"""GPU: --true-on-policy (common/model/exact.py): the trainer's logprobs equal vLLM's bit for bit.

    python -m pytest -q -s tests/gpu/test_true_on_policy_gpu.py      (GPU machine, stack of shared/device)

1. `torchrun --nproc_per_node N tests/gpu/test_true_on_policy_gpu.py --tp N` (N = 1, and 2 with two GPUs: the
   trainer and the engine both at tensor parallel size N): test_vllm_agreement.py's random Qwen2
   (8 layers, hidden 512, head size 64, q/k/v bias, GQA), megatron on the engine's kernels, vLLM batch-invariant
   and eager. Reported (a diagnosis, not asserted): whether vLLM's kernels give a row the same bits alone as
   among many; every module's output, vLLM's hooks against megatron's, on the prefill rows and the decode rows
   of one sequence; the trainer's rows alone against batched; vLLM's prompt logprobs against the trainer's.
   Asserted: 64 sampled responses of 48 tokens (T=1), every trainer logprob of a sampled token (padded rows)
   equal to vLLM's exactly (0 differing tokens).
2. train_grpo.py on a random model of Qwen2-0.5B's shape (packed micro-batches; at --tp 1, and at --tp 2
   --rollout-tp 2 with two GPUs) and of Llama-3.2-1B's (no q/k/v bias, llama3 rope scaling; --tp 1) with
   --true-on-policy
   --check-on-policy 0: logprob_mismatch 0.0 at every step and ppo_kl 0.0 (the gate stops the run otherwise);
   the same run without the flag: a mismatch > 0 (the control). Printed: rollout and step seconds of both runs
   (the mode's cost).
"""

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.gpu.script_runs import launch_checked, run_script  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _differs(a, b):
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    n = int((a != b).sum())
    return f"{n}/{a.numel()} differ, max {float((a - b).abs().max()):.3g}" if n else "equal"


def rows(calls, p):
    """vLLM's rows of one sequence: the prefill call's first p, then each decode call's first (a call's batch
    may be padded)."""
    calls = [x.reshape(-1, x.shape[-1]) for x in calls]
    return torch.cat([calls[0][:p]] + [x[:1] for x in calls[1:]])


def by_module(engine, chunks, spec, prompt, tp, max_tokens=8):
    """vLLM's and megatron's outputs of every module of every layer on one sequence -> lines. vLLM generates
    max_tokens from the prompt alone (its prefill, then one decode step per token), megatron runs prompt +
    response in one forward; the rows of vLLM's calls, concatenated, are megatron's rows."""
    vmodel, seen = engine.model, {}

    def keep(name):
        def hook(module, inputs, output):
            seen.setdefault(name, []).append((output[0] if isinstance(output, tuple) else output).detach().clone())

        return hook

    handles = []
    for i, layer in enumerate(vmodel.model.layers):
        for sub in ("input_layernorm", "self_attn.qkv_proj", "self_attn.attn", "self_attn.o_proj",
                    "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn", "mlp.down_proj"):  # fmt: skip
            handles.append(layer.get_submodule(sub).register_forward_hook(keep(f"v{i}.{sub}")))
    handles.append(vmodel.model.norm.register_forward_hook(keep("v.norm")))
    sample = engine.generate([prompt], n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)[0]
    for h in handles:
        h.remove()
    ours = {"input_layernorm": "input_layernorm", "self_attn.qkv_proj": "self_attention.linear_qkv",
            "self_attn.attn": "self_attention.core_attention", "self_attn.o_proj": "self_attention.linear_proj",
            "post_attention_layernorm": "pre_mlp_layernorm", "mlp.gate_up_proj": "mlp.linear_fc1",
            "mlp.act_fn": "mlp.activation_func", "mlp.down_proj": "mlp.linear_fc2"}  # fmt: skip
    model, handles = chunks[0], []
    for i, layer in enumerate(model.decoder.layers):
        for sub, mine in ours.items():
            handles.append(layer.get_submodule(mine).register_forward_hook(keep(f"m{i}.{sub}")))
    handles.append(model.decoder.final_layernorm.register_forward_hook(keep("m.norm")))
    ids = list(prompt) + list(sample.response_ids[:-1])
    n, p = len(ids), len(prompt)
    with torch.no_grad():
        model(torch.tensor([ids], device="cuda"), torch.arange(n, device="cuda")[None], None)
    for h in handles:
        h.remove()
    heads, groups = spec.num_heads // tp, spec.num_kv_heads // tp  # this rank's (vLLM's and megatron's alike)
    lines = []
    for i in range(len(model.decoder.layers)):
        for sub in ours:
            v = rows(seen[f"v{i}.{sub}"], p)
            m = seen[f"m{i}.{sub}"][-1].reshape(n, -1)
            if sub == "self_attn.qkv_proj":  # megatron's per-group [q.., k, v] columns -> vLLM's [q; k; v]
                d = m.shape[-1] // (heads + 2 * groups)
                g = m.view(n, groups, heads // groups + 2, d)
                m = torch.cat([g[:, :, :-2].reshape(n, -1), g[:, :, -2].flatten(1), g[:, :, -1].flatten(1)], 1)
            lines.append(f"layer {i} {sub}: prefill {_differs(v[:p], m[:p])}; decode {_differs(v[p:], m[p:])}")
    v, m = rows(seen["v.norm"], p), seen["m.norm"][-1].reshape(n, -1)
    lines.append(f"final norm: prefill {_differs(v[:p], m[:p])}; decode {_differs(v[p:], m[p:])}")
    return lines


def trainer_batch_by_module(chunks, a, b):
    """The trainer's own batch invariance, module by module: sequence a alone against a in a batch with b
    (right-padded rows, a first) -> lines for the modules whose rows of a differ."""
    model, seen, handles = chunks[0], {}, []
    names = ["embedding", "output_layer", "decoder.final_layernorm"]
    for i, _ in enumerate(model.decoder.layers):
        names += [f"decoder.layers.{i}.{m}" for m in ("input_layernorm", "self_attention.linear_qkv",
                  "self_attention.core_attention", "self_attention.linear_proj", "pre_mlp_layernorm",
                  "mlp.linear_fc1", "mlp.activation_func", "mlp.linear_fc2")]  # fmt: skip
    for name in names:

        def hook(module, inputs, output, name=name):
            seen.setdefault(name, []).append((output[0] if isinstance(output, tuple) else output).detach().clone())

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    n = max(len(a), len(b))
    with torch.no_grad():
        for rows in ([a], [a + [0] * (n - len(a)), b + [0] * (n - len(b))]):
            ids = torch.tensor(rows, device="cuda")
            model(ids, torch.arange(ids.shape[1], device="cuda").expand_as(ids), None)
    for h in handles:
        h.remove()
    lines = []
    for name in names:
        alone, batch = seen[name]  # (s, b, ...)
        lines.append(f"{name}: {_differs(alone[: len(a), 0], batch[: len(a), 0])}")
    return lines


def kernel_invariance():
    """Whether vLLM's kernels give a row the same bits alone (or among few rows) as among many -> {name: bool}."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    g, out = torch.Generator(device="cuda").manual_seed(0), {}
    for hidden in (512, 896, 3584):
        x, r = (torch.randn(300, hidden, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(hidden, device="cuda", generator=g, dtype=torch.bfloat16)
        few, many = (x[:100].clone(), r[:100].clone()), (x.clone(), r.clone())
        ops.fused_add_rms_norm(*few, w, 1e-6)
        ops.fused_add_rms_norm(*many, w, 1e-6)
        out[f"fused_add_rms_norm_{hidden}"] = bool(torch.equal(few[0], many[0][:100]))
        out[f"triton_rms_norm_{hidden}"] = bool(
            torch.equal(rms_norm_batch_invariant(x[:100], w), rms_norm_batch_invariant(x, w)[:100])
        )
        weight = torch.randn(1000, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
        out[f"linear_{hidden}"] = bool(
            torch.equal(linear_batch_invariant(x[:1], weight), linear_batch_invariant(x, weight)[:1])
        )
    logits = torch.randn(300, 32000, device="cuda", generator=g)
    ids = torch.randint(0, 32000, (300, 1), device="cuda", generator=g)
    out["token_logprobs"] = bool(
        torch.equal(compute_token_logprobs(logits[:1], ids[:1]), compute_token_logprobs(logits, ids)[:1])
    )
    return out


def compared(samples, chunks, spec):
    """The engine's sampled-token logprobs against the trainer's (padded rows): how many differ, where."""
    from tests.gpu.test_vllm_agreement import megatron_logprobs

    with torch.no_grad():
        ours = megatron_logprobs(chunks, spec, samples, 1.0)
    engine = [torch.tensor(s.response_logprobs) for s in samples]
    diff = torch.cat(engine) - torch.cat(ours)
    first = sum(int(e[0] != o[0]) for e, o in zip(engine, ours))
    return dict(
        tokens=diff.numel(),
        differing=int((diff != 0).sum()),
        first_token_differing=first,
        samples=len(samples),
        mean=diff.abs().mean().item(),
        max=diff.abs().max().item(),
    )


def main(tp):
    import torch.distributed as dist

    from common.model.exact import bind, convert
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import export_hf_weights
    from common.model.weights_load import load_hf_weights
    from common.rollout.vllm_engine import VLLMEngine
    from common.run.dist import init_distributed
    from tests.gpu.test_vllm_agreement import VOCAB, megatron_logprobs, write_model

    info = init_distributed(tp=tp)
    hf_dir = [tempfile.mkdtemp(prefix="true_on_policy_") if info.rank == 0 else None]
    dist.broadcast_object_list(hf_dir)  # one node: a shared /tmp
    hf_dir = hf_dir[0]
    if info.rank == 0:
        write_model(hf_dir)
    dist.barrier()
    spec = load_hf_spec(hf_dir)
    chunks = build_model(spec, tp=tp, dtype=torch.bfloat16)
    load_hf_weights(chunks, spec, hf_dir)
    convert(chunks)
    engine = VLLMEngine(
        hf_dir, rollout_tp=tp, gpu_memory_utilization=0.3, max_model_len=512, seed=0, batch_invariant=True
    )
    bind(engine)
    engine.update_weights(export_hf_weights(chunks, spec, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (16,), generator=g)
    ]
    res = {"tp": tp, "kernels": kernel_invariance(), "modules": by_module(engine, chunks, spec, prompts[0], tp)}
    print("\n".join(res["modules"]), flush=True)
    samples = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=48, seed=1)
    res["padded"] = compared(samples, chunks, spec)
    single = engine.generate(prompts[:1], n=1, temperature=1.0, top_p=1.0, max_tokens=48, seed=2)
    res["one_request"] = compared(single, chunks, spec)  # the engine decoding one sequence alone
    with torch.no_grad():  # the trainer's own batch invariance: one row at a time against the batch
        alone = torch.cat([megatron_logprobs(chunks, spec, [s], 1.0)[0] for s in samples[:8]])
        batched = torch.cat(megatron_logprobs(chunks, spec, samples[:8], 1.0))
    res["trainer_one_row_vs_batch"] = int((alone != batched).sum())
    a, b = samples[0], samples[5]
    res["trainer_modules"] = trainer_batch_by_module(
        chunks, a.prompt_ids + a.response_ids, b.prompt_ids + b.response_ids
    )
    scored = engine.score(samples[:8])  # the engine's prefill (prompt logprobs of prompt + response)
    res["engine_prefill_vs_trainer"] = int((torch.tensor(sum(scored, [])) != batched).sum())
    print("RESULT", json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"true_on_policy_probe_tp{tp}_rank{info.rank}.json"), "w") as f:
            json.dump(res, f, indent=1)
    assert res["padded"]["differing"] == 0, res["padded"]
    os._exit(0)  # an in-process engine can hang interpreter shutdown


def two_gpus(tp):
    return pytest.mark.skipif(tp > torch.cuda.device_count(), reason=f"needs {tp} GPUs")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=two_gpus(2))])
def test_logprobs_equal_engine(tp):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp)]
    out = launch_checked([*launch, __file__, "--tp", str(tp)], 400)
    print(out[-6000:])


FLAGS = ["--steps", "3", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--max-new-tokens", "32"]
FLAGS += ["--eval-every", "0", "--rollout", "vllm", "--rollout-logprobs", "all"]


@pytest.mark.parametrize(
    "shape,tp", [("0.5b", 1), ("llama-1b", 1), pytest.param("0.5b", 2, marks=two_gpus(2))], ids=["1", "llama-1", "2"]
)
def test_grpo_run_on_policy(tmp_path, shape, tp):
    model = tmp_path / "model"  # tests/gpu/make_random_model.py's shape, the byte tokenizer
    launch_checked([sys.executable, "tests/gpu/make_random_model.py", str(model), "--shape", shape], 120)
    keys = ["logprob_mismatch", "ppo_kl", "rollout_s", "step_s"]
    runs = {}
    for name, extra in (("exact", ["--true-on-policy", "--check-on-policy", "0"]), ("default", [])):
        layout = ["--tp", tp, "--rollout-tp", tp]
        rows, _ = run_script(
            "train_grpo.py", tmp_path / name, "--model", model, *FLAGS, *layout, *extra, ranks=tp, timeout=500
        )
        runs[name] = [{k: r.get(k) for k in keys} for r in rows]
        print(name, runs[name], flush=True)
    assert all(r["logprob_mismatch"] == 0.0 for r in runs["exact"])
    assert runs["exact"][0]["ppo_kl"] == 0.0  # (the gate, --check-on-policy 0, also stops a run that is not)
    assert all(r["logprob_mismatch"] > 0 for r in runs["default"])


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="the trainer's and the engine's tensor parallel size")
    main(ap.parse_args().tp)
