"""Worker for tests/test_exact.py: --true-on-policy's forward at tensor parallel size 2, on the CPU.

    torchrun --nproc_per_node 2 tests/exact_worker.py --model-dir DIR --tp 2 [--sp] --out result.json

The model of --model-dir is built twice at the layout with the same weights; one is converted
(common/model/exact.py) onto tests/test_exact.py's reference kernels. Per rank, for padded rows and for packed
rows: the largest logit difference (the vocabulary shards gathered), the largest gradient difference relative to
its tensor's scale, the log-probabilities through the hook (which gathers the shards as vLLM does) against the
vocab-parallel ones, the kernels' call counts, the widths the linear kernel multiplied (this rank's shards) and
the widest row the log-probability kernel saw.
"""

import argparse
import collections
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist


def install_reference_kernels(spec, calls, seen):
    from common.model import exact
    from common.rl import logprobs
    from tests.test_exact import REFERENCES, rope_table

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            if name == "linear":
                seen["linear_out"].add(tuple(args[1].shape))
            if name == "token_logprobs":
                seen["logprob_row"] = max(seen.get("logprob_row", 0), args[0].shape[-1])
            return fn(*args, **kwargs)

        return call

    exact.KERNELS = types.SimpleNamespace(**{k: counted(k, f) for k, f in REFERENCES.items()})
    exact.ENGINE.update(block_size=4, is_neox=True, logits_dtype=torch.float32, cos_sin=rope_table(spec))
    logprobs.EXACT_TOKEN_LOGPROBS = exact.token_logprobs
    return exact


def run_layout(args):
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.rl import logprobs
    from common.run.dist import init_distributed
    from tests.test_exact import forward, grads

    init_distributed(tp=args.tp)
    group = mpu.get_tensor_model_parallel_group()
    spec = load_hf_spec(args.model_dir)
    calls, seen = collections.Counter(), {"linear_out": set()}
    exact = install_reference_kernels(spec, calls, seen)
    hook = logprobs.EXACT_TOKEN_LOGPROBS
    models = {}
    for name in ("plain", "converted"):
        chunks = build_model(spec, tp=args.tp, sequence_parallel=args.sp)
        load_hf_weights(chunks, spec, args.model_dir)
        models[name] = chunks[0]
    exact.convert([models["converted"]])
    rows = {}
    for case, shape, packed in (("padded", (3, 12), None), ("packed", (1, 18), [3, 9, 6])):
        ids = torch.randint(0, spec.vocab_size, shape, generator=torch.Generator().manual_seed(3))
        targets = torch.roll(ids, -1, dims=1)
        calls.clear()
        out = {}
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            logprobs.EXACT_TOKEN_LOGPROBS = hook if name == "converted" else None
            logits = forward(model, ids, packed)  # (B, T, V_padded / tp)
            values, _ = logprobs.vocab_parallel_logprobs(logits, targets, spec.vocab_size, group)
            (values.sum() + logits.float().square().mean()).backward()
            parts = [torch.empty_like(logits.detach().contiguous()) for _ in range(args.tp)]
            dist.all_gather(parts, logits.detach().contiguous(), group=group)
            out[name] = torch.cat(parts, -1)[..., : spec.vocab_size], values.detach(), grads(model)
        (a, la, ga), (b, lb, gb) = out["plain"], out["converted"]
        rows[case] = {
            "logits": (a - b).abs().max().item(),
            "logprobs": (la - lb).abs().max().item(),
            "grad_rel": max(((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp(min=1e-12)).item() for k in ga),
            "grad_names": sorted(ga) == sorted(gb) and len(ga) > 10,
            "calls": dict(calls),
            "linear_out": sorted({w[0] for w in seen["linear_out"]}),
            "logprob_row": seen.get("logprob_row", 0),
        }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return gathered


def parse_layout(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sp", action="store_true", help="sequence parallel")
    return ap.parse_args(argv)


if __name__ == "__main__":
    from tests.layouts import main

    main(parse_layout, run_layout)
