"""Worker of tests/test_qwen35.py: the gradient of every HF tensor of a model at a TP layout.

    torchrun --nproc_per_node 2 tests/gdn_grad_worker.py --hf DIR --tp 2 --sp --out grads.pt

Loads the HF model, takes a fixed random projection of the real-vocabulary logits as the loss,
runs the backward, sums over TP what megatron's finalize_model_grads sums (q/k norms; with SP
the parameters tagged sequence_parallel) and routed experts' gradients over the expert-data-
parallel ranks (DDP's sum; at TP > 1 with ETP = 1 each TP rank's experts see its own tokens),
and saves the gradients under their HF names (through export_hf_weights, the gradient put in
place of each parameter) from rank 0.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import export_hf_weights
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    init_distributed(tp=args.tp)
    spec = load_hf_spec(args.hf)
    chunks = build_model(spec, tp=args.tp, sequence_parallel=args.sp)
    load_hf_weights(chunks, spec, args.hf)
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = chunks[0](ids, torch.arange(24).unsqueeze(0), None)  # (B, T, V_padded/tp)
    width = logits.shape[-1]
    weights = torch.randn(2, 24, spec.vocab_size, generator=torch.Generator().manual_seed(5))
    weights = torch.nn.functional.pad(weights, (0, width * args.tp - spec.vocab_size))  # padding (per TP): left out
    start = mpu.get_tensor_model_parallel_rank() * width
    (logits.float() * weights[..., start : start + width]).sum().backward()
    for name, p in chunks[0].named_parameters():  # what finalize_model_grads all-reduces over TP
        if args.tp > 1 and (
            "q_layernorm" in name or "k_layernorm" in name or (args.sp and getattr(p, "sequence_parallel", False))
        ):
            dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
        if args.tp > 1 and ".local_experts." in name:  # what DDP sums over the expert-data-parallel ranks
            dist.all_reduce(p.grad, group=mpu.get_expert_data_parallel_group())
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(p.grad)
    grads = {name: t.clone() for name, t in export_hf_weights(chunks, spec, dtype=torch.float32, bucket_mb=0.05)}
    if dist.get_rank() == 0:
        torch.save(grads, args.out)
