"""Worker for tests/test_model_parity.py, run under torchrun (gloo):

    torchrun --nproc_per_node 2 tests/parity_worker.py --models-dir DIR --tp 2 --out result.json

For every tiny HF model in --models-dir (and each --model): build the megatron model at the given layout,
load the HF weights sharded, run a forward pass through megatron's pipeline schedule, gather
the vocab-parallel logits and compare with transformers (fp32). Then export every tensor
back and compare bit-for-bit with the safetensors file. Deliberately wrong mappings
(k/v swapped, or for multi-latent attention the router's score-correction bias dropped;
at TP>1 fc1 cut as a plain chunk of [gate; up]; for MoE models two experts of a layer
exchanged; for a model on uneven pipeline stages the layers after the first stage loaded one
layer too early, as an even split's offset would) must NOT match. --ep/--etp: expert (tensor)
parallel sizes. MoE models also: the load-balancing loss and expert load of a right-padded
batch, through the trainer's path, against transformers' with the attention mask.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist


def forward_logits(chunks, ids, seq_len):
    """Full-vocabulary logits (B, T, V_padded) on every rank, via the pipeline schedule."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = []
    positions = torch.arange(seq_len).unsqueeze(0)

    def step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch, positions, None)

        def collect(output):
            out.append(output.detach())
            return output.sum() * 0, {}

        return logits, collect

    # one sequence per micro-batch (interleaved pipelines need >= pp micro-batches)
    micro_batches = list(ids.split(1))
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(micro_batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_len,
        micro_batch_size=1,
        forward_only=True,
    )
    pp_last = mpu.is_pipeline_last_stage()
    shape = (ids.shape[0], seq_len, chunks[-1].vocab_size // mpu.get_tensor_model_parallel_world_size())
    local = torch.cat(out) if pp_last else torch.empty(shape)
    if mpu.get_pipeline_model_parallel_world_size() > 1:  # last stage -> all stages
        group = mpu.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(group, mpu.get_pipeline_model_parallel_world_size() - 1)
        local = local.contiguous()
        dist.broadcast(local, src=last, group=group)
    parts = [torch.empty_like(local) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def compare_dispatchers(spec, hf_dir, layout, ids, seq_len, reference):
    """--moe-dispatcher allgather (common/model/moe.py DeviceSortDispatcher at EP > 1: every rank's
    tokens gathered, this rank's experts' pairs sorted first, the other rows masked) against
    megatron's all-to-all, same weights: logits vs transformers, and every parameter's
    gradient of one random projection of the logits (this rank's shard) against all-to-all's."""
    from common.model.gpt import build_model
    from common.model.moe_experts import GroupedExperts
    from common.model.weights_load import load_hf_weights

    out, grads = {}, {}
    for dispatcher in ("alltoall", "allgather"):
        chunks = build_model(spec, **layout, moe_token_dispatcher_type=dispatcher)
        load_hf_weights(chunks, spec, hf_dir)
        out[f"{dispatcher}_dispatchers"] = sorted(
            {type(m.token_dispatcher).__name__ for m in chunks[0].modules() if hasattr(m, "token_dispatcher")}
        )
        logits = chunks[0](ids, torch.arange(seq_len).unsqueeze(0), None)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11))
        (logits.float() * weights).sum().backward()
        grads[dispatcher] = {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}
        if dispatcher == "allgather":
            with torch.no_grad():
                out["allgather_max_abs_diff"] = (
                    (forward_logits(chunks, ids, seq_len)[..., : spec.vocab_size] - reference).abs().max().item()
                )
                # megatron's per-expert loop instead of the grouped GEMMs (what fp32 on a GPU runs)
                experts = [m for m in chunks[0].modules() if isinstance(m, GroupedExperts)]
                for m in experts:
                    m.grouped = False
                out["allgather_loop_max_abs_diff"] = (
                    (forward_logits(chunks, ids, seq_len)[..., : spec.vocab_size] - reference).abs().max().item()
                )
                for m in experts:
                    m.grouped = True
    ours, theirs = grads["allgather"], grads["alltoall"]
    out["dispatch_grad_names_equal"] = sorted(ours) == sorted(theirs)
    out["dispatch_grad_params"] = len(theirs)
    out["dispatch_max_grad_rel_diff"] = max(
        float((ours[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in theirs.items()
    )
    return out


def routing_statistics(chunks, spec, layout, hf, seq_len):
    """The MoE metrics of one update pass over a right-padded batch, taken the trainer's way
    (batch.pack_sequences -> micro_batches -> schedule.run_micro_batches, whose padding_mask keeps the
    padding out of the routers' statistics; then moe.step_metrics), against the same statistics
    from transformers' router logits over the valid tokens (its load_balancing_loss_func with
    the attention mask, per MoE layer; HF counts each token's k expert slots without dividing
    by k, so k times megatron's loss). Then the same pass without `valid` (no padding_mask)
    against transformers without a mask. Returns {"masked"|"unmasked": (ours, transformers)},
    or for a model with a router score-correction bias (DeepSeek-V3: no aux loss, its own
    top-k) {"masked"|"unmasked": (tokens the bias update counted, k x the tokens it should)}."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe import moe_utils
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from common.model.chunks import unwrap
    from common.model.moe import routers, step_metrics
    from common.rl import batch as B
    from common.train import schedule

    # what earlier models' passes with gradients left there (megatron sizes the tracker by the first model's layers)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    rng = torch.Generator().manual_seed(5)
    samples = [
        SimpleNamespace(
            prompt_ids=torch.randint(1, 300, (p,), generator=rng).tolist(),
            response_ids=torch.randint(1, 300, (r,), generator=rng).tolist(),
            response_logprobs=[0.0] * r,
        )
        for p, r in ((6, seq_len - 6), (5, 8), (4, 3))
    ]  # 24, 13 and 7 of 24 positions real
    batch = B.pack_sequences(samples, pad_id=0, length=seq_len)
    for chunk in chunks:
        chunk.train()  # the routers' losses apply in training only
    topk, experts = spec.moe.topk, spec.moe.num_experts
    result = {}
    for case in ("masked", "unmasked"):
        passes = B.micro_batches(
            batch if case == "masked" else {k: v for k, v in batch.items() if k != "valid"},
            torch.arange(len(samples)),
            len(samples),
            length_multiple=8 * layout["tp"],
        )
        schedule.run_micro_batches(
            chunks,
            passes,
            lambda mb, logits: (logits.float().sum() * 0, {}),
            forward_only=False,
            device=torch.device("cpu"),
        )
        if unwrap(chunks[0]).config.moe_router_enable_expert_bias:  # (every rank: a stage may hold no MoE layer)
            # megatron's counts for the bias update (all passes so far), over the SP shards
            biased = [router for _, router in routers(chunks)]
            counted = sum(router.local_tokens_per_expert.sum() for router in biased) + torch.zeros(())
            dist.all_reduce(counted, group=mpu.get_tensor_model_parallel_group())
            real = int(batch["valid"].sum()) if case == "masked" else batch["valid"].numel()
            result[case] = (counted.item() - sum(r[0] for r in result.values()), topk * len(biased) * real)
            continue
        ours = step_metrics(chunks, spec, torch.device("cpu"))
        with torch.no_grad():
            mask = batch["valid"].long() if case == "masked" else None
            router_logits = hf(input_ids=batch["tokens"], attention_mask=mask, output_router_logits=True).router_logits
        loads, aux = [], 0.0
        for logits in router_logits:  # one (B*T, E) per MoE layer
            picked = logits.softmax(-1).topk(topk, dim=-1).indices
            keep = torch.ones(len(logits), dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
            counts = torch.bincount(picked[keep].reshape(-1), minlength=experts).float()
            loads.append((counts.max() / counts.mean()).item())
            aux += load_balancing_loss_func((logits,), experts, topk, mask).item() / topk
        theirs = {"moe_load_max": max(loads), "moe_load_mean": sum(loads) / len(loads), "moe_aux_loss": aux}
        result[case] = (ours, theirs)
    for chunk in chunks:
        chunk.eval()
    return result


def saved_bytes(chunk, ids):
    """Bytes of the tensors one forward with gradients saves for its backward (each storage once,
    parameters left out): what the memory plan's activation formula estimates."""
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
    return sum(saved.values())


def parse_layout(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--model", action="append", default=[], help="one more HF model dir (repeatable)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1)
    return ap.parse_args(argv)


def run_layout(args):
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import common.model.chunks as chunks_module
    import common.model.weights_load as weights_module
    from common.model import bridge
    from common.model.chunks import named_global_parameters, unwrap
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import export_hf_weights
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    info = init_distributed(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    layout = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp, sequence_parallel=args.sp)
    seq_len = 24
    ids = torch.randint(0, 300, (2, seq_len), generator=torch.Generator().manual_seed(7))
    results = {}
    for hf_dir in [os.path.join(args.models_dir, n) for n in sorted(os.listdir(args.models_dir))] + args.model:
        name = os.path.basename(hf_dir)
        spec = load_hf_spec(hf_dir)

        def logits_with(hf_dir=hf_dir, spec=spec):
            chunks = build_model(spec, **layout)
            load_hf_weights(chunks, spec, hf_dir)
            for c in chunks:
                c.eval()
            with torch.no_grad():
                return chunks, forward_logits(chunks, ids, seq_len)[..., : spec.vocab_size]

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = hf(input_ids=ids).logits
        chunks, logits = logits_with()
        row = {
            "max_abs_diff": (logits - reference).abs().max().item(),
            "layers": [layer.layer_number - 1 for c in chunks for layer in unwrap(c).decoder.layers],
            # for the memory plan (tests/test_model_parity.py): this rank's parameters and, without a
            # pipeline, the bytes its forward saves for the backward per token
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "param_count": sum(p.numel() for c in chunks for p in c.parameters()),
        }
        if spec.moe is not None:  # load-balancing loss, expert load or bias-update counts, padding left out
            row["routing_statistics"] = routing_statistics(chunks, spec, layout, hf, seq_len)
        if spec.moe is not None and args.ep > 1 and args.pp == 1:  # the two token dispatchers at EP > 1
            row.update(compare_dispatchers(spec, hf_dir, layout, ids, seq_len, reference))

        # export: every HF tensor, bit-identical, no missing or extra names
        on_disk = {}
        for f in os.listdir(hf_dir):
            if f.endswith(".safetensors"):
                on_disk.update(load_file(os.path.join(hf_dir, f)))
        exported = {k: v.clone() for k, v in export_hf_weights(chunks, spec, dtype=torch.float32, bucket_mb=0.05)}
        row["export_missing"] = sorted(set(on_disk) - set(exported))
        row["export_extra"] = sorted(set(exported) - set(on_disk))
        row["export_mismatch"] = sorted(
            k for k in set(on_disk) & set(exported) if not torch.equal(on_disk[k], exported[k])
        )
        # routed experts as stacked ExpertBlocks (the vLLM sync's form): expanded, the same tensors
        from common.model.weights import ExpertBlock

        via_blocks, row["expert_blocks"] = {}, 0
        for hf_name, t in export_hf_weights(chunks, spec, dtype=torch.float32, bucket_mb=0.05, expert_blocks=True):
            if isinstance(t, ExpertBlock):
                row["expert_blocks"] += 1
                via_blocks.update((n, x.clone()) for n, x in t.hf())
            else:
                via_blocks[hf_name] = t.clone()
        row["blocks_mismatch"] = sorted(
            k
            for k in set(on_disk) | set(via_blocks)
            if k not in via_blocks or k not in on_disk or not torch.equal(on_disk[k], via_blocks[k])
        )
        # each rank's own TP pieces (the vLLM sync at Megatron TP = vLLM TP), for a consumer that
        # reads any box: every piece equals its box of the HF tensor, every tensor comes once
        from common.model.weights import LocalShard

        class ReadsAnything:
            def reads_within(self, *box):
                return True

        row["pieces"], seen, row["pieces_mismatch"] = 0, [], []
        for hf_name, t in export_hf_weights(
            chunks, spec, dtype=torch.float32, bucket_mb=0.05, local_reads=ReadsAnything()
        ):
            seen.append(hf_name)
            if isinstance(t, LocalShard):
                row["pieces"] += 1
                expected = on_disk[hf_name].narrow(t.dim, t.start, t.tensor.shape[t.dim])
                if tuple(t.full_shape) != tuple(on_disk[hf_name].shape) or not torch.equal(t.tensor, expected):
                    row["pieces_mismatch"].append(hf_name)
            elif not torch.equal(t, on_disk[hf_name]):
                row["pieces_mismatch"].append(hf_name)
        if sorted(seen) != sorted(on_disk):
            row["pieces_mismatch"].append("names differ")

        # negative control 1: k and v swapped in the fused qkv; with multi-latent attention
        # (no qkv) the router's score-correction bias left at zero instead
        if spec.mla is None:
            from common.model import bridge_gdn

            rules, gated = dict(bridge._LAYER_RULES), bridge_gdn._GATED_QKV  # (Qwen3.5's gated q/k/v too)
            kind, names = rules["self_attention.linear_qkv.weight"]
            bridge._LAYER_RULES["self_attention.linear_qkv.weight"] = (kind, [names[0], names[2], names[1]])
            bridge_gdn._GATED_QKV = (gated[0], [gated[1][0], gated[1][2], gated[1][1]])
            row["control_kv_swapped"] = (logits_with()[1] - reference).abs().max().item()
            bridge._LAYER_RULES.update(rules)
            bridge_gdn._GATED_QKV = gated
        else:
            chunks_zero_bias, _ = logits_with()
            with torch.no_grad():
                for chunk in chunks_zero_bias:
                    for module in chunk.modules():
                        if getattr(module, "expert_bias", None) is not None:
                            module.expert_bias.zero_()
                row["control_kv_swapped"] = (
                    (forward_logits(chunks_zero_bias, ids, seq_len)[..., : spec.vocab_size] - reference)
                    .abs()
                    .max()
                    .item()
                )
        # negative control 2 (TP>1): fc1 as a plain chunk of [gate; up]
        if args.tp > 1:
            original = bridge.shard_from_hf

            def naive(kind, hf_names, read, spec, tp_rank, tp_size):
                if kind == "gate_up":
                    full = torch.cat([read(hf_names[0]), read(hf_names[1])])
                    return full.chunk(tp_size)[tp_rank]
                return original(kind, hf_names, read, spec, tp_rank, tp_size)

            weights_module.shard_from_hf = naive
            row["control_naive_fc1"] = (logits_with()[1] - reference).abs().max().item()
            weights_module.shard_from_hf = original
        # negative control 3 (MoE): experts 0 and 1 of the first MoE layer of every rank exchanged
        if spec.moe is not None:
            chunks, _ = logits_with()
            params = dict(named_global_parameters(chunks[0], global_experts=False))
            first = next((n for n in params if ".local_experts.0.linear_fc1" in n), None)
            if first is not None:
                with torch.no_grad():
                    for suffix in ("linear_fc1.weight", "linear_fc2.weight"):
                        a, b = (params[first.replace("0.linear_fc1.weight", f"{j}.{suffix}")] for j in (0, 1))
                        tmp = a.clone()
                        a.copy_(b)
                        b.copy_(tmp)
            with torch.no_grad():
                swapped = forward_logits(chunks, ids, seq_len)[..., : spec.vocab_size]
            row["control_experts_swapped"] = (swapped - reference).abs().max().item()
        # negative control 4 (uneven pipeline stages): the layers after the first stage loaded from
        # the layer before each, where an offset that ignored the bigger first stage would put them
        if bridge.pipeline_layout(spec.num_layers, args.pp, args.vpp):

            def shifted(chunk, global_experts=True):
                for n, p in named_global_parameters(chunk, global_experts):
                    parts = n.split(".", 3)
                    later = parts[1] == "layers" and mpu.get_pipeline_model_parallel_rank() > 0
                    source = int(parts[2]) - 1 if later else 0
                    if later and spec.gdn is not None:  # Qwen3.5: the layer before of the same type
                        kinds = spec.gdn.linear_layers
                        source = max(j for j in range(int(parts[2])) if kinds[j] == kinds[int(parts[2])])
                    yield (f"decoder.layers.{source}.{parts[3]}" if later else n), p

            chunks_module.named_global_parameters = shifted
            row["control_shifted_layers"] = (logits_with()[1] - reference).abs().max().item()
            chunks_module.named_global_parameters = named_global_parameters
        if args.pp == 1:  # last: its forward (with gradients) would count in the routers' statistics
            row["saved_bytes_per_token"] = saved_bytes(chunks[0], ids[:1]) / seq_len
        rows = [None] * info.world_size
        dist.all_gather_object(rows, row)
        results[name] = rows
    return results


if __name__ == "__main__":
    from tests.layouts import main

    main(parse_layout, run_layout)
