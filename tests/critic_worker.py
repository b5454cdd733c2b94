"""Worker for tests/test_critic.py, run under torchrun (gloo) or as one plain process:

    torchrun --nproc_per_node 2 tests/critic_worker.py --models-dir DIR --tp 2 --sp --out result.json

For every HF model dir in --models-dir (each holds a `score.weight` / `score.bias` value head
next to the causal-LM weights): build the critic at the given layout, load it with
load_critic_weights, and run forward + backward of loss = sum(values * c) (c a fixed random
(B, T) tensor) through megatron's pipeline schedule. Reports, from the last pipeline stage:
the values (B, T), the value head's gradients and the final norm's gradient (summed over
TP ranks under sequence parallelism, as megatron's finalize_model_grads does for
sequence-parallel norm weights). The test computes the same numbers with transformers.
Also loads the critic from the dir WITHOUT a score head (--plain-suffix) and reports the
largest |value| (the head must start at exactly 0).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

B, T = 2, 16


def inputs():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 300, (B, T), generator=g)
    c = torch.randn(B, T, generator=g, dtype=torch.float64).float()  # weights of the values in the loss
    return ids, c


def parse_layout(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--plain-suffix", default="_plain", help="<name><suffix>: the same model without a score head")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    return ap.parse_args(argv)


def run_layout(args):
    from megatron.core import parallel_state as mpu

    from common.model.critic import build_critic, load_critic_weights
    from common.model.gpt import load_hf_spec
    from common.run.dist import init_distributed
    from common.train import schedule

    info = init_distributed(tp=args.tp, pp=args.pp)
    ids, c = inputs()
    results = {}
    for name in sorted(os.listdir(args.models_dir)):
        if name.endswith(args.plain_suffix):
            continue
        hf_dir = os.path.join(args.models_dir, name)
        spec = load_hf_spec(hf_dir)
        chunks = build_critic(spec, tp=args.tp, pp=args.pp, sequence_parallel=args.sp)
        load_critic_weights(chunks, spec, hf_dir)
        store = {}

        def loss_fn(mb, values):  # values: (1, T, 1) on the last stage
            values = values.squeeze(-1)
            store[int(mb["row"])] = values.detach().clone()
            # megatron divides by the number of micro-batches: undo it, so grads are of sum(values * c)
            return (values * mb["c"]).sum() * B, {}

        mbs = [
            dict(tokens=ids[i : i + 1], positions=torch.arange(T)[None], c=c[i : i + 1], row=torch.tensor(i))
            for i in range(B)
        ]
        schedule.run_micro_batches(chunks, mbs, loss_fn, forward_only=False, device=info.device)
        row = {"last_stage": mpu.is_pipeline_last_stage()}
        if row["last_stage"]:
            model = chunks[-1]
            norm_grad = model.decoder.final_layernorm.weight.grad.clone()
            if args.sp and args.tp > 1:  # each TP rank holds the part of its own sequence rows
                dist.all_reduce(norm_grad, group=mpu.get_tensor_model_parallel_group())
            head = model.output_layer
            row.update(
                values=torch.cat([store[i] for i in range(B)]).tolist(),
                head_weight_grad=head.weight.grad.view(-1).tolist(),
                head_bias_grad=head.bias.grad.tolist(),
                norm_grad=norm_grad.tolist(),
            )

        # the same model without a score head: the value head starts at exactly zero
        plain = build_critic(spec, tp=args.tp, pp=args.pp, sequence_parallel=args.sp)
        load_critic_weights(plain, spec, hf_dir + args.plain_suffix)
        zero_store = {}

        def zero_fn(mb, values):
            zero_store[int(mb["row"])] = values.detach().abs().max().item()
            return values.sum() * 0, {}

        with torch.no_grad():
            schedule.run_micro_batches(plain, mbs, zero_fn, forward_only=True, device=info.device)
        if row["last_stage"]:
            row["plain_max_abs_value"] = max(zero_store.values())
        rows = [None] * info.world_size
        dist.all_gather_object(rows, row)
        results[name] = rows
    return results


if __name__ == "__main__":
    from tests.layouts import main

    main(parse_layout, run_layout)
