"""Worker for tests/test_rl.py, run under torchrun (gloo):

    torchrun --nproc_per_node 2 tests/rl_worker.py --out result.json

Every rank builds the same full logits (B, T, tp * V_local), keeps its vocab shard, and runs
common.rl.vocab_parallel_logprobs over the TP group (a group made with dist.new_group). Rank 0
writes, per case and rank, the max errors of logprobs, entropy and the gradient of
(logprobs * w).sum() + (entropy * w2).sum() against a single-process torch.log_softmax
reference on the full logits, plus the largest tensor any collective carried.
Cases: no vocab padding, padding inside rank 1's shard, rank 1 holding only padding, bf16.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from common.rl.logprobs import vocab_parallel_logprobs

B, T = 3, 5

# record every all_reduce's size, to check that nothing vocab-sized crosses the wire
collective_numels = []
_all_reduce = dist.all_reduce


def recording_all_reduce(tensor, *args, **kwargs):
    collective_numels.append(tensor.numel())
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = recording_all_reduce


def reference(full, targets, vocab_size, temperature):
    """Single-process ground truth on the full (unsharded) logits."""
    logp_all = torch.log_softmax(full[..., :vocab_size].double() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def run_case(v_local, vocab_size, temperature, dtype, compute_entropy, tp_group):
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    gen = torch.Generator().manual_seed(1000 * v_local + vocab_size)  # same on every rank
    full = (3 * torch.randn(B, T, tp_size * v_local, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab_size, (B, T), generator=gen)
    w = torch.randn(B, T, generator=gen)
    w2 = torch.randn(B, T, generator=gen)

    ref_full = full.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = reference(ref_full, targets, vocab_size, temperature)
    ref_loss = (ref_lp * w).sum() + ((ref_ent * w2).sum() if compute_entropy else 0.0)
    ref_loss.backward()

    shard = full[..., tp_rank * v_local : (tp_rank + 1) * v_local].detach().clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        shard, targets, vocab_size, tp_group=tp_group, temperature=temperature, compute_entropy=compute_entropy
    )
    loss = (lp * w).sum() + ((ent * w2).sum() if compute_entropy else 0.0)
    loss.backward()

    ref_grad = ref_full.grad[..., tp_rank * v_local : (tp_rank + 1) * v_local].double()
    return {
        "logprobs_err": (lp.double() - ref_lp).abs().max().item(),
        "entropy_err": (ent.double() - ref_ent).abs().max().item() if compute_entropy else 0.0,
        "entropy_is_none": ent is None,
        "grad_err": (shard.grad.double() - ref_grad).abs().max().item(),
        "grad_dtype": str(shard.grad.dtype),
        "logprobs_dtype": str(lp.dtype),
        # gradient on padding columns must be exactly 0
        "pad_grad_max": shard.grad[..., max(0, vocab_size - tp_rank * v_local) :].abs().max().item()
        if vocab_size < (tp_rank + 1) * v_local
        else 0.0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # rendezvous through a file next to --out, not torchrun's MASTER_ADDR/PORT: with
    # `--master_port 0` (tests/conftest.py) torch 2.13's agent hands the workers MASTER_PORT=0
    # instead of the port it bound, and env:// initialisation then waits forever.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.abspath(args.out)}.store",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    tp_group = dist.new_group(list(range(dist.get_world_size())))

    cases = {  # name: (v_local, vocab_size, temperature, dtype, compute_entropy)
        "no_padding": (8, 16, 1.0, torch.float32, True),
        "padding_in_last_shard": (8, 13, 0.7, torch.float32, True),
        "last_shard_all_padding": (8, 7, 1.3, torch.float32, True),
        "logprobs_only": (8, 13, 0.7, torch.float32, False),
        "bf16_input": (8, 13, 1.0, torch.bfloat16, True),
    }
    results = {}
    for name, case in cases.items():
        results[name] = run_case(*case, tp_group=tp_group)
    results["max_collective_numel"] = max(collective_numels)
    results["num_collectives"] = len(collective_numels)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "ranks": gathered, "B": B, "T": T}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
