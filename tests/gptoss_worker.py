"""Worker for tests/test_gptoss.py, run under torchrun (gloo), several layouts per launch (tests/layouts.py):

    torchrun --nproc_per_node 2 tests/gptoss_worker.py --hf DIR --tp 2 --out result.json

The tiny gpt-oss at the given layout against transformers (fp32): logits of padded rows through
megatron's pipeline schedule; packed rows (megatron's THD format, two samples in one row) against
each sample alone in transformers; the export back to HF names bit-identical (experts fused again);
and controls that must NOT match: the sinks at zero, every layer's window off (full attention), the
experts of the first layer exchanged in pairs. With --mxfp4 DIR also the same model loaded from MXFP4 expert blocks.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from tests.parity_worker import forward_logits

SEQ = 24


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--mxfp4", default=None, help="the same model with MXFP4 expert weights (dequantised on load)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    return ap.parse_args(argv)


def packed_logits(chunk, spec, ids, lengths):
    """One row of the samples ids[i, :lengths[i]] packed (THD), full-vocabulary logits (t, V)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens = torch.cat([ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    local = chunk(tokens, positions, None, packed_seq_params=params)[0]  # (t, V/tp)
    parts = [torch.empty_like(local) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[:, : spec.vocab_size]


def run(args):
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from common.model.chunks import named_global_parameters, unwrap
    from common.model.gpt import build_model, load_hf_spec
    from common.model.gptoss import GptOssExperts, SinkAttention
    from common.model.weights import export_hf_weights
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    info = init_distributed(tp=args.tp, pp=args.pp, ep=args.ep)
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, sequence_parallel=args.sp)
    spec = load_hf_spec(args.hf)
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(7))
    hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(input_ids=ids).logits

    def built(hf_dir=args.hf):
        chunks = build_model(spec, **layout)
        load_hf_weights(chunks, spec, hf_dir)
        for c in chunks:
            c.eval()
        return chunks

    def diff(chunks):
        with torch.no_grad():
            return (forward_logits(chunks, ids, SEQ)[..., : spec.vocab_size] - reference).abs().max().item()

    chunks = built()
    row = {
        "max_abs_diff": diff(chunks),
        "layers": [layer.layer_number - 1 for c in chunks for layer in unwrap(c).decoder.layers],
        "param_count": sum(p.numel() for c in chunks for p in c.parameters()),
    }
    if args.pp == 1 and not args.sp:  # packed rows: samples of 17 and 7 tokens in one row
        lengths = [17, 7]
        with torch.no_grad():
            alone = torch.cat([hf(input_ids=ids[i : i + 1, :n]).logits[0] for i, n in enumerate(lengths)])
            row["packed_max_abs_diff"] = (packed_logits(chunks[0], spec, ids, lengths) - alone).abs().max().item()
    on_disk = load_file(os.path.join(args.hf, "model.safetensors"))
    exported = {k: v.clone() for k, v in export_hf_weights(chunks, spec, dtype=torch.float32, bucket_mb=0.05)}
    row["export_missing"] = sorted(set(on_disk) - set(exported))
    row["export_extra"] = sorted(set(exported) - set(on_disk))
    row["export_mismatch"] = sorted(k for k in set(on_disk) & set(exported) if not torch.equal(on_disk[k], exported[k]))
    if args.mxfp4:
        row["mxfp4_max_abs_diff_to_plain"] = diff(built(args.mxfp4))
    experts = [m for c in chunks for m in c.modules() if isinstance(m, GptOssExperts)]
    row["experts_grouped"] = all(m.grouped_path() for m in experts)  # a CPU: torch's grouped GEMM's loop
    for m in experts:  # the per-expert loop (what fp32 on a GPU runs)
        m.grouped = False
    row["loop_max_abs_diff"] = diff(chunks)
    for m in experts:
        m.grouped = True

    # controls: each of these must move the logits far off
    attentions = [m for c in chunks for m in c.modules() if isinstance(m, SinkAttention)]
    with torch.no_grad():
        sinks = [m.softmax_offset.clone() for m in attentions]
        for m in attentions:
            m.softmax_offset.zero_()
        row["control_no_sinks"] = diff(chunks)
        for m, s in zip(attentions, sinks):
            m.softmax_offset.copy_(s)
        windows = [m.window for m in attentions]
        for m in attentions:
            m.window = None
        row["control_no_windows"] = diff(chunks)
        for m, w in zip(attentions, windows):
            m.window = w
        params = dict(named_global_parameters(chunks[0], global_experts=False))
        first = next(n for n in params if ".local_experts.0.linear_fc1.weight" in n)
        pairs = [(j, j + 1) for j in range(0, spec.moe.num_experts // args.ep, 2)]  # every local pair exchanged
        for (i, j), suffix in ((p, s) for p in pairs for s in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")):
            a, b = (params[first.replace("0.linear_fc1.weight", f"{e}.linear_{suffix}")] for e in (i, j))
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)
        row["control_experts_swapped"] = diff(chunks)
    row["pp_rank"] = mpu.get_pipeline_model_parallel_rank()
    rows = [None] * info.world_size
    dist.all_gather_object(rows, row)
    return rows


if __name__ == "__main__":
    from tests.layouts import main

    main(parse, run)
