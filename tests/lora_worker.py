"""Worker of tests/test_lora.py (common/model/lora.py), under torchrun on gloo:

    torchrun --nproc_per_node 1 tests/lora_worker.py HF_DIR --mode grads --out R.json
    torchrun --nproc_per_node 2 tests/lora_worker.py HF_DIR --layouts '{"tp2": ["--tp", "2"]}' --out R.json

grads (one process, fp32): the logits with B = 0 against the base model's (bit for bit), and the adapters'
gradients of a loss against the chain rule through an explicit merged weight W' = W + s B A (autograd on
W' in fp32: dB = s dW' A^T, dA = s B^T dW'); then, bf16, the optimizer's bytes with and without LoRA.
layouts: from the same start, two Adam steps on the adapters; the logits before and after and the merged
HF weights of the export are saved by rank 0 to OUT_DIR/<tp>-<sp>.pt for the test to compare across layouts.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.parity_worker import forward_logits  # noqa: E402

RANK, ALPHA, TARGETS = 4, 8.0, ("attention", "mlp")


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("hf_dir")
    p.add_argument("--mode", choices=["grads", "layouts"], default="layouts")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    return p.parse_args(argv)


def tiny(args, dtype=torch.float32):
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    init_distributed(tp=args.tp)
    spec = load_hf_spec(args.hf_dir)
    chunks = build_model(spec, tp=args.tp, sequence_parallel=args.sp, dtype=dtype)
    load_hf_weights(chunks, spec, args.hf_dir)
    return spec, chunks


def token_ids(spec):
    return torch.randint(3, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def grads(args):
    """B = 0 bit for bit; the adapters' gradients by the chain rule; the optimizer's bytes."""
    from common.model import lora
    from common.model.chunks import unwrap
    from common.train.setup import setup_training

    spec, chunks = tiny(args)
    ids = token_ids(spec)
    positions = torch.arange(ids.shape[1])[None]
    model = unwrap(chunks[0])
    model.requires_grad_(False)  # the base as a frozen model computes it (the reference model; megatron's frozen path)
    base = model(ids, positions, None).detach()
    adapted = lora.add_lora(chunks, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=0)
    b0 = model(ids, positions, None).detach()
    result = dict(adapted=adapted, b0_equal=bool(torch.equal(base, b0)))
    with lora.adapters_disabled(chunks):
        result["disabled_equal"] = bool(torch.equal(base, model(ids, positions, None).detach()))
    # B random (as after some training), then one backward of a fixed linear function of the logits
    gen = torch.Generator().manual_seed(2)
    modules = lora.lora_modules(chunks)
    for module in modules.values():
        module.lora_b.data.copy_(torch.randn(module.lora_b.shape, generator=gen) * 0.05)
    weights = torch.randn(base.shape, generator=gen)
    # one row (b = 1, as rollout rows are packed): the frozen output layer's backward must be one GEMM over the
    # tokens, not a batched (1 x V) @ (V x H) product per token (megatron's transposed logits; lora._RowMajorGrad)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (model(ids[:1], positions, None) * weights[:1]).sum().backward()
    result["vocab_bmm"] = sum(
        e.name == "aten::bmm" and any(shape and shape[-1] == base.shape[-1] for shape in e.input_shapes)
        for e in prof.events()
    )
    for module in modules.values():  # (the gradients checked below are of the next backward alone)
        module.lora_a.grad = module.lora_b.grad = None
    (model(ids, positions, None) * weights).sum().backward()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    result["trainable_only_adapters"] = all(lora.is_adapter(n) for n in trainable) and len(trainable) == 2 * adapted
    # the same loss through a model without adapters whose weights are W' = W + s B A, computed here in fp32
    _, plain = tiny(args)
    plain_model = unwrap(plain[0])
    plain_model.requires_grad_(False)
    plain_modules = dict(plain_model.named_modules())
    merged = {}
    for name, module in modules.items():
        target = plain_modules[name]
        target.weight.data.copy_(module.weight + module.lora_scale * module.lora_b @ module.lora_a)
        target.weight.requires_grad_(True)
        merged[name] = target.weight
    logits = plain_model(ids, positions, None)
    result["merged_logits_err"] = (logits - model(ids, positions, None)).abs().max().item()
    (logits * weights).sum().backward()
    errs = []
    for name, module in modules.items():
        dw, s = merged[name].grad, module.lora_scale
        for got, want in (
            (module.lora_b.grad, s * dw @ module.lora_a.T),
            (module.lora_a.grad, s * module.lora_b.T @ dw),
        ):
            errs.append(((got - want).abs().max() / want.abs().max()).item())
    result.update(grad_max_rel_err=max(errs), grad_tensors=len(errs))
    # bf16: what the optimizer holds with LoRA against full fine-tuning
    args_bf16 = argparse.Namespace(**vars(args))
    for name, with_lora in (("full", False), ("lora", True)):
        _, bf16 = tiny(args_bf16, dtype=torch.bfloat16)
        if with_lora:
            lora.add_lora(bf16, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=0)
            result["adapter_numel"] = lora.adapter_bytes(bf16)[0]
        result["model_numel"] = sum(p.numel() for n, p in unwrap(bf16[0]).named_parameters() if not lora.is_adapter(n))
        result[name] = optimizer_bytes(*setup_training(bf16, lr=1e-3)[:2])
    return result


def optimizer_bytes(ddp_chunks, optimizer):
    """Bytes of the DDP gradient buffers, the fp32 main params and the Adam moments (after its state exists)."""
    from common.train.setup import ensure_adam_state, torch_adams

    ensure_adam_state(optimizer)
    grad = sum(b.grad_data.numel() * b.grad_data.element_size() for c in ddp_chunks for b in c.buffers)
    main = moments = 0
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                main += p.numel() * p.element_size()
                moments += sum(v.numel() * v.element_size() for k, v in adam.state[p].items() if k != "step")
    return dict(grad=grad, main=main, moments=moments)


def layouts(args):
    """Two Adam steps on the adapters at this layout; rank 0 saves the logits and the merged export."""
    import torch.distributed as dist

    from common.model import lora
    from common.model.weights import export_hf_weights
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule
    from common.train.setup import setup_training

    spec, chunks = tiny(args)
    ids = token_ids(spec)
    for chunk in chunks:  # the base as a frozen model computes it (the reference model; megatron's frozen path)
        chunk.requires_grad_(False)
    base = forward_logits(chunks, ids, ids.shape[1])[..., : spec.vocab_size]
    lora.add_lora(chunks, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=0)
    model, optimizer, scheduler = setup_training(chunks, lr=1e-2)
    b0 = forward_logits(chunks, ids, ids.shape[1])[..., : spec.vocab_size]  # (the modules inside DDP)
    from megatron.core import parallel_state as mpu

    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = ids[dp_rank * 2 // dp : (dp_rank + 1) * 2 // dp]  # each data-parallel rank its rows
    mb = dict(tokens=mine, positions=torch.arange(16)[None].expand_as(mine), targets=mine.roll(-1, 1))
    mb["mask"] = torch.ones(mine.shape)

    def loss_fn(mb, logits):
        logprobs, _ = vocab_parallel_logprobs(
            logits, mb["targets"], spec.vocab_size, mpu.get_tensor_model_parallel_group()
        )
        return -logprobs.sum() / ids.numel() * dp, {}

    norms = [schedule.train_step(model, optimizer, scheduler, [mb], loss_fn, torch.device("cpu"))[1] for _ in range(2)]
    after = forward_logits(chunks, ids, ids.shape[1])[..., : spec.vocab_size]
    exported = {name: t.clone() for name, t in export_hf_weights(model, spec, dtype=torch.float32)}
    if dist.get_rank() == 0:
        out_dir = os.path.dirname(os.path.abspath(sys.argv[sys.argv.index("--out") + 1]))
        torch.save(
            dict(base=base, after=after, exported=exported), os.path.join(out_dir, f"tp{args.tp}-sp{args.sp}.pt")
        )
    return dict(b0_equal=bool(torch.equal(base, b0)), grad_norms=norms, changed=bool((after - base).abs().max() > 1e-3))


def run(args):
    return grads(args) if args.mode == "grads" else layouts(args)


if __name__ == "__main__":
    from tests.layouts import main

    main(parse, run)
