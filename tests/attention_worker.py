"""Worker for tests/test_attention.py: SDPA vs local core attention, one layout per run.

    torchrun --nproc_per_node 2 tests/attention_worker.py --models-dir DIR --tp 2 --out result.json

For every tiny HF model in --models-dir: build the megatron model twice at the given layout,
once with attention="local" (megatron's DotProductAttention) and once with "sdpa"
(common/model/attention.py), load the same HF weights, and run forward + backward of the
vocab-parallel cross entropy. Rank 0 writes, per model and rank: max |logits - transformers|
for both, max |logits_sdpa - logits_local|, and the largest gradient difference relative to
the gradient scale. Runs in-process too (world of one) for the TP=1 case.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist


def forward_backward(spec, hf_dir, attention, ids, tp, sequence_parallel):
    """(full-vocab logits (B, T, V), {param name: grad}) of one model on this rank."""
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model
    from common.model.weights_load import load_hf_weights

    model = build_model(spec, tp=tp, sequence_parallel=sequence_parallel, attention=attention)[0]
    load_hf_weights([model], spec, hf_dir)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = model(ids, positions, None)  # (B, T, V_padded/tp)
    labels = torch.roll(ids, -1, dims=1)
    loss = model(ids, positions, None, labels=labels).mean()  # vocab-parallel CE, (B, T) -> ()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    local = logits.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : spec.vocab_size], grads


def compare(models_dir, tp, sequence_parallel=False, seq_len=32):
    """One row per model: the numbers test_attention.py asserts on (this rank's view)."""
    from transformers import AutoModelForCausalLM

    from common.model.gpt import load_hf_spec

    ids = torch.randint(0, 300, (2, seq_len), generator=torch.Generator().manual_seed(11))
    rows = {}
    for name in sorted(os.listdir(models_dir)):
        hf_dir = os.path.join(models_dir, name)
        spec = load_hf_spec(hf_dir)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = hf(input_ids=ids).logits
        local_logits, local_grads = forward_backward(spec, hf_dir, "local", ids, tp, sequence_parallel)
        sdpa_logits, sdpa_grads = forward_backward(spec, hf_dir, "sdpa", ids, tp, sequence_parallel)
        assert local_grads.keys() == sdpa_grads.keys(), "the two specs have different parameters"
        # gradient difference relative to that tensor's largest gradient (norms and
        # embeddings have very different scales)
        grad_rel = max(
            ((sdpa_grads[k] - local_grads[k]).abs().max() / local_grads[k].abs().max().clamp(min=1e-12)).item()
            for k in local_grads
        )
        rows[name] = {
            "local_vs_hf": (local_logits - reference).abs().max().item(),
            "sdpa_vs_hf": (sdpa_logits - reference).abs().max().item(),
            "sdpa_vs_local": (sdpa_logits - local_logits).abs().max().item(),
            "grad_max_rel_diff": grad_rel,
            "grad_nonzero": all(bool(g.abs().sum() > 0) for g in sdpa_grads.values()),
            "num_params": len(sdpa_grads),
        }
    return rows


def parse_layout(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallel")
    return ap.parse_args(argv)


def run_layout(args):
    from common.run.dist import init_distributed

    info = init_distributed(tp=args.tp)
    rows = compare(args.models_dir, args.tp, args.sp)
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, rows)
    return {name: [r[name] for r in gathered] for name in rows}


if __name__ == "__main__":
    from tests.layouts import main

    main(parse_layout, run_layout)
