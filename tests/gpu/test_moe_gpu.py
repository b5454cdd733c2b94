"""GPU: Mixture-of-Experts on the GPU stack: grouped experts, and vLLM agreeing with megatron.

    torchrun --standalone --nproc_per_node 1 tests/gpu/test_moe_gpu.py     (tests/gpu/run_all.sh)
    torchrun --standalone --nproc_per_node 2 tests/gpu/test_moe_gpu.py --ep 2 [--rollout-tp 2]

A random Qwen3-MoE-shaped model (bf16; hidden 512, 4 layers, 32 experts of 256, top-8,
q/k norm, renormalised top-k) is written with transformers. Checked:
  1. common/model/moe_experts.py's GroupedExperts (torch._grouped_mm) against SequentialMLP's per-expert
     loop on the same weights and tokens: relative error of the logits and of all gradients
     against the loop in fp32, no more than twice the bf16 loop's own (their speed:
     bench/moe.py);
  2. vLLM (dummy weights, every tensor from export_hf_weights' per-expert names) vs megatron:
     mean |logprob difference| of sampled tokens <= 0.02 (or 2.5x megatron's own bf16 error
     against fp32 transformers), and the share of (token, layer) pairs whose top-k experts
     differ between vLLM and megatron on the same teacher-forced sequences (reported: the
     root of MoE trainer/rollout mismatch).
With --ep 2 (two GPUs) megatron holds half of every layer's experts per rank (NCCL
all-to-all dispatch, the sync gathering experts over EP) and vLLM runs one engine per GPU
(--rollout-tp 1) or one over both (--rollout-tp 2); the samples of both replicas are scored.
Results go to $OUT/moe_gpu[_ep2_rankN].json when OUT is set.
"""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

VOCAB = 32000
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# std of the random inner weights (--inner-std): the larger, the larger the residual stream and
# bf16's own error on the logprobs (DeepSeek-V3's model: 0.040 from fp32 at 0.035, 0.019 at 0.02)
INNER_STD = 0.035


def write_model(out_dir, arch="Qwen3MoeForCausalLM", fields=MODEL):
    """Random weights as in test_vllm_agreement.py (inner std INNER_STD, lm_head 0.1, norms near 1);
    router std 0.1 so that routing is decided by the input, not by ties; a router score-
    correction bias (DeepSeek-V3) ~ 0.05, so that it changes which experts are chosen."""
    import transformers

    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields)
    config.architectures = [arch]
    model = getattr(transformers, arch)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = 0.1 if name == "lm_head.weight" or name.endswith("mlp.gate.weight") else INNER_STD
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out_dir)


def grouped_vs_sequential(chunks, res):
    """Forward + backward of the same batch four ways: bf16 per-expert loop, bf16 grouped, the
    loop in fp32 (the same bf16-rounded weights) as the reference, and bf16 grouped under
    megatron DDP as training runs it (weights read and gradients added in DDP's buffers). The
    grouped paths must be no noisier than the loop: relative error of the logits and of all
    gradients together."""
    from common.model.moe_experts import GroupedExperts

    model = chunks[0]
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    tokens = torch.randint(10, VOCAB, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    positions = torch.arange(256, device="cuda").expand_as(tokens)
    out = {}
    for name, grouped, dtype in (
        ("loop", False, torch.bfloat16),
        ("grouped", True, torch.bfloat16),
        ("fp32", False, torch.float32),
    ):
        model.to(dtype)
        for m in experts:
            m.grouped = grouped
        for p in model.parameters():
            p.grad = None
        logits = model(tokens, positions, None).float()
        logits.logsumexp(-1).mean().backward()
        out[name] = (logits.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    model.to(torch.bfloat16)
    for m in experts:
        m.grouped = True
    # as in training: megatron DDP with the distributed optimizer, whose buffers hold the expert
    # weights and gradients evenly spaced, so the grouped GEMMs read the weights in place and add
    # their gradients there in place (common/model/moe_experts.py GroupedExperts.stacks): main_grad afterwards
    from common.train.setup import setup_training

    for p in model.parameters():
        p.grad = None  # (DDP's hooks would add the fp32 run's gradients left here into main_grad)
    ddp, _, _ = setup_training(chunks, lr=0.0)
    for chunk in ddp:
        chunk.zero_grad_buffer()
    logits = ddp[0](tokens, positions, None).float()
    logits.logsumexp(-1).mean().backward()
    out["in_place"] = (logits.detach(), torch.cat([p.main_grad.float().flatten() for p in model.parameters()]))
    # layers whose buffers hold them evenly spaced (read in place with DeviceSortDispatcher; megatron's
    # all-to-all dispatcher sorts rows the other way, and the layer then stacks copies)
    res["in_place_layers"] = sum(all(m.stacks()[k] is not None for k in ("w1", "w2", "g1", "g2")) for m in experts)
    ref_logits, ref_grads = out["fp32"]
    for name in ("loop", "grouped", "in_place"):
        logits, grads = out[name]
        res[f"{name}_logits_rel_err"] = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        res[f"{name}_grads_rel_err"] = ((grads - ref_grads).norm() / ref_grads.norm()).item()
    assert res["in_place_layers"] == len(experts) > 0, res
    for what in ("logits", "grads"):
        for name in ("grouped", "in_place"):
            assert res[f"{name}_{what}_rel_err"] <= 2 * res[f"loop_{what}_rel_err"] + 1e-3, res


def capture_vllm_topk(engine, sequences, topk, select=None):
    """Top-k expert sets per (token, layer) of vLLM's routers on teacher-forced sequences (one
    prefill each, prefix cache reset so that every token is computed). select(logits, gate
    module) -> (tokens, topk) expert indices; default: the top-k of the router logits."""
    model = engine.model
    gates = {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}
    layer_of = {name: int(name.split(".layers.")[1].split(".")[0]) for name in gates}
    select = select or (lambda logits, gate: logits.topk(topk, -1).indices)
    captured = {}
    hooks = [
        m.register_forward_hook(
            lambda m, inp, out, name=name: captured.setdefault(layer_of[name], []).append(
                select((out[0] if isinstance(out, tuple) else out).float(), m).sort(-1).values.cpu()
            )
        )
        for name, m in gates.items()
    ]
    from vllm import SamplingParams

    per_seq = []
    try:
        for seq in sequences:
            captured.clear()
            engine.llm.reset_prefix_cache()
            engine.llm.generate(
                [{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
            )
            per_seq.append({layer: torch.cat(parts)[: len(seq)] for layer, parts in captured.items()})
    finally:
        for h in hooks:
            h.remove()
    return per_seq


def megatron_topk(chunks, sequences):
    from common.model.moe import routers

    captured = {}
    hooks = [
        r.register_forward_hook(lambda m, inp, out, layer=layer: captured.__setitem__(layer, out[1].cpu()))
        for layer, r in routers(chunks)
    ]
    per_seq = []
    try:
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq], device="cuda")
                chunks[0](ids, torch.arange(len(seq), device="cuda")[None], None)
                # routing_map (tokens, E) bool -> sorted expert indices (tokens, topk)
                per_seq.append(
                    {layer: m.nonzero()[:, 1].view(m.shape[0], -1).sort(-1).values for layer, m in captured.items()}
                )
    finally:
        for h in hooks:
            h.remove()
    return per_seq


def topk_differences(theirs, mine):
    """Per sequence {layer: (tokens, k) sorted expert indices} from vLLM and megatron -> the
    number of (token, layer) pairs compared and the share whose expert sets differ."""
    differ = total = 0
    for a, b in zip(theirs, mine):
        for layer in b:
            if layer in a and a[layer].shape == b[layer].shape:
                differ += int((a[layer] != b[layer]).any(-1).sum())
                total += b[layer].shape[0]
    return dict(topk_pairs_compared=total, topk_differ_frac=differ / max(total, 1))


def vllm_against_megatron(hf_dir, chunks, spec, vocab, tag, res, rollout_tp=1):
    """Start a VLLMEngine on hf_dir (config only, dummy weights), sync it from the megatron
    chunks (timed: res["timings"]), sample 8 random prompts x 4 at T=1 and record the mean
    |logprob difference| of the sampled tokens, vLLM vs megatron and each vs fp32
    transformers, in res. Returns (engine, samples)."""
    from transformers import AutoModelForCausalLM

    from common.rollout.vllm_engine import VLLMEngine
    from tests.gpu.test_vllm_agreement import gather_all, hf_logprobs, megatron_logprobs, sync

    t = time.perf_counter()
    engine = VLLMEngine(
        hf_dir, rollout_tp=rollout_tp, gpu_memory_utilization=0.3, max_model_len=512, seed=0, enforce_eager=True
    )
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    timings = res["timings"] = {}
    sync(engine, chunks, spec, timings, tag)
    g = torch.Generator().manual_seed(100 + engine.replica)  # different prompts per vLLM replica
    prompts = [
        torch.randint(10, vocab, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (8,), generator=g)
    ]
    # every rank scores every replica's samples (expert-parallel ranks run each forward together)
    samples = gather_all(engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=32, seed=1))
    vllm_lp = torch.cat([torch.tensor(s.response_logprobs) for s in samples])
    ours = torch.cat(megatron_logprobs(chunks, spec, samples, 1.0))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    exact = torch.cat(hf_logprobs(hf, samples, 1.0))
    del hf
    res.update(
        tokens=len(vllm_lp),
        mean_abs_diff=(vllm_lp - ours).abs().mean().item(),
        vllm_vs_fp32=(vllm_lp - exact).abs().mean().item(),
        megatron_vs_fp32=(ours - exact).abs().mean().item(),
    )
    return engine, samples


def setup(ep, prefix, arch="Qwen3MoeForCausalLM", fields=MODEL, dispatcher=None):
    """torch.distributed + megatron at expert parallel size ep, the random model written by
    rank 0 into a temporary dir (one node: a shared /tmp), built and loaded sharded; dispatcher:
    megatron's token dispatcher (None: the default; "allgather" at EP > 1 is fine here: every
    rank passes batches of the same size).
    Returns (DistInfo, hf_dir, spec, chunks, res with the layout)."""
    import torch.distributed as dist

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    info = init_distributed(ep=ep)
    hf_dir = [tempfile.mkdtemp(prefix=prefix) if info.rank == 0 else None]
    dist.broadcast_object_list(hf_dir)
    hf_dir = hf_dir[0]
    if info.rank == 0:
        write_model(hf_dir, arch, fields)
    dist.barrier()
    spec = load_hf_spec(hf_dir)
    overrides = {"moe_token_dispatcher_type": dispatcher} if dispatcher else {}
    chunks = build_model(spec, ep=ep, dtype=torch.bfloat16, **overrides)
    load_hf_weights(chunks, spec, hf_dir)
    kinds = sorted(
        {type(m.token_dispatcher).__name__ for c in chunks for m in c.modules() if hasattr(m, "token_dispatcher")}
    )
    return (
        info,
        hf_dir,
        spec,
        chunks,
        {"rank": info.rank, "world": info.world_size, "ep": ep, "dispatchers": kinds, "inner_std": INNER_STD},
    )


def result_path(name, info, ep):
    suffix = f"_ep{ep}_rank{info.rank}" if info.world_size > 1 else ""
    return os.path.join(os.environ["OUT"], f"{name}{suffix}.json")


def run(ep=1, rollout_tp=1, dispatcher=None):
    from tests.gpu.test_vllm_agreement import replay_against_loader

    info, hf_dir, spec, chunks, res = setup(ep, "moe_gpu_", dispatcher=dispatcher)
    grouped_vs_sequential(chunks, res)
    print("RESULT grouped", json.dumps(res), flush=True)
    for c in chunks:
        c.eval()

    engine, samples = vllm_against_megatron(hf_dir, chunks, spec, VOCAB, "moe", res, rollout_tp)
    res["replay"] = replay_against_loader(engine, chunks, spec)  # the replayed sync = vLLM's loader
    sequences = [s.prompt_ids + s.response_ids for s in samples[::4]]
    theirs, mine = capture_vllm_topk(engine, sequences, MODEL["num_experts_per_tok"]), megatron_topk(chunks, sequences)
    res.update(topk_differences(theirs, mine))
    total = res["topk_pairs_compared"]
    print("RESULT", json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        with open(result_path("moe_gpu", info, ep), "w") as f:
            json.dump(res, f, indent=1)
    assert res["mean_abs_diff"] <= max(0.02, 2.5 * res["megatron_vs_fp32"]), res
    assert total > 0, "no router outputs captured"
    assert not res["replay"]["broken"] and res["replay"]["params_differ_count"] == 0, res["replay"]


def main(run, inner_std=INNER_STD):
    """The entry point of this test and test_deepseek_gpu.py; inner_std: --inner-std's default."""
    global INNER_STD  # read by write_model (this module's, also under test_deepseek_gpu.py)
    import argparse

    from tests.gpu.test_vllm_agreement import run_then_exit

    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1, help="megatron's expert parallel size (one process per GPU)")
    ap.add_argument("--rollout-tp", type=int, default=1, help="vLLM's tensor parallel size")
    ap.add_argument(
        "--moe-dispatcher",
        choices=["alltoall", "allgather"],
        default=None,
        help="megatron's token dispatcher at --ep > 1 (default: the scripts', alltoall)",
    )
    ap.add_argument(
        "--inner-std",
        type=float,
        default=inner_std,
        help="std of the random model's inner weights (bf16's own error grows with it)",
    )
    args = ap.parse_args()
    INNER_STD = args.inner_std
    run_then_exit(run, args.ep, args.rollout_tp, args.moe_dispatcher)


if __name__ == "__main__":
    main(run)
