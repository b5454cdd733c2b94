"""Worker of tests/test_packing.py: packed passes against padded ones, at any layout (gloo).

    python tests/packing_worker.py --models-dir D --models qwen2 qwen3 --out R.json
    torchrun --nproc_per_node 2 tests/packing_worker.py --models-dir D --models qwen2 --tp 2 --sp --out R.json
    torchrun --nproc_per_node 2 tests/packing_worker.py --models-dir D --models qwen2 --cp 2 --out R.json

For each tiny HF model (fp32), 24 samples of very different lengths (prompts 2-9 tokens,
responses 1-60) are scored twice by the same model: length-sorted padded micro-batches
(batch.micro_batches) and packed rows of at most 64 tokens (batch.packed_micro_batches).
Each data-parallel rank takes its rows, as train_grpo.py does. With --cp both layouts are cut
over the CP ranks (batch.context_parallel_slice; packed samples padded to 2 * cp as the scripts
do), and the per-sequence terms sum over the CP group. Compared, on response tokens:
  - the logprobs of a forward-only pass, scattered back with batch.scatter_tokens and summed
    over all ranks (train_grpo.py's logprob_pass);
  - the gradient of a GSPO-style loss (sequence-level ratio, seq_mean_token_mean), whose two
    per-sequence terms need the packed sample ids;
  - with --critic, the values of a critic (build_critic) and the gradient of its token loss.
A negative control scores the packed rows as if each were one sequence (control_diff).
MoE models at EP > 1 are also scored with megatron's all-gather token dispatcher
(--moe-dispatcher allgather: DeviceSortDispatcher), whose passes must hold as many tokens on
every EP rank (batch.micro_batches same_tokens: padded passes of up to 64 tokens, with empty
rows where a rank has fewer, and packed ones), against the all-to-all's padded passes:
allgather_logprob_diff / allgather_grad_diff (packed and padded, the larger).
Writes {model: {logprob_diff, control_diff, grad_diff, grad_max, value_diff, ...,
padded_tokens, packed_tokens}} (the maxima over all ranks) from rank 0.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def samples_for(spec):
    from common.rollout.engine import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):
        p, r = 2 + i % 8, 1 + (i * 13) % 60
        ids = torch.randint(3, spec.vocab_size, (p + r,), generator=gen).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * r, "stop"))
    return samples


def score(model, mbs, batch, loss_of, output_of, info):
    """(per-token outputs (N, T) summed over ranks, the flat local gradient) of one
    forward-backward over micro-batches."""
    from megatron.core import parallel_state as mpu

    from common.rl import batch as B
    from common.train import schedule

    num_rows, width = batch["mask"].shape
    store = torch.zeros(num_rows + 1, width, device=info.device)  # + the spare row of packed tails
    tp_first = mpu.get_tensor_model_parallel_rank() == 0

    def loss_fn(mb, output):
        per_token = output_of(mb, output).detach()  # (TP collectives inside: every TP rank)
        if tp_first:
            B.scatter_tokens(store, mb, per_token)
        return loss_of(mb, output) * len(mbs) * info.dp_size, {}

    for chunk in model:
        chunk.zero_grad_buffer()
    schedule.run_micro_batches(model, mbs, loss_fn, forward_only=False, device=info.device)  # (grads reduced over DP)
    dist.all_reduce(store)
    grads = torch.cat([p.main_grad.flatten().clone() for chunk in model for p in chunk.parameters()])
    return store[:num_rows].cpu(), grads.cpu()


def parse_layout(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--critic", action="store_true")
    return ap.parse_args(argv)


def run_layout(args):
    from megatron.core import parallel_state as mpu

    from common.model.critic import build_critic, load_critic_weights
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.rl import batch as B
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss, policy_loss
    from common.run.dist import init_distributed
    from common.train.setup import setup_training

    info = init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, sequence_parallel=args.sp)
    tp_group = mpu.get_tensor_model_parallel_group()
    cp_group = mpu.get_context_parallel_group() if args.cp > 1 else None
    multiple, sample_multiple = B.length_multiples(args.tp, args.cp)  # as the scripts'
    results = {}
    for name in args.models:
        hf_dir = os.path.join(args.models_dir, name)
        spec = load_hf_spec(hf_dir)
        # no MoE aux loss: it balances the tokens of each pass, which differ (padding vs none)
        chunks = build_model(spec, dtype=torch.float32, moe_aux_loss_coef=0.0, **layout)
        load_hf_weights(chunks, spec, hf_dir)
        model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=False)
        samples = samples_for(spec)
        batch = B.pack_sequences(samples, pad_id=0, length_multiple=multiple)
        batch["row"] = torch.arange(len(samples))
        batch["advantages"] = (
            torch.randn(len(samples), generator=torch.Generator().manual_seed(2))[:, None] * batch["mask"]
        )
        batch["noise"] = torch.randn(batch["mask"].shape, generator=torch.Generator().manual_seed(1)) * 0.1
        per_dp = len(samples) // info.dp_size
        rows = torch.arange(info.dp_rank * per_dp, (info.dp_rank + 1) * per_dp)
        peers = mpu.get_data_parallel_group() if args.ep > 1 else None  # as the scripts' expert_peers
        padded = B.micro_batches(batch, rows, 4, length_multiple=multiple, same_length=args.pp > 1)
        packed = B.micro_batches(
            batch,
            rows,
            4,
            length_multiple=multiple,
            same_length=args.pp > 1,
            max_tokens=64,
            pack=True,
            same_count_group=peers,
            sample_multiple=sample_multiple,
        )

        def logprobs_of(mb, logits):
            return vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size, tp_group)[0]

        def gspo_loss(mb, logits):  # the two per-sequence terms: GSPO's ratio and the per-sequence mean
            logprobs = logprobs_of(mb, logits)
            old = logprobs.detach() + mb["noise"]
            per_token, _ = policy_loss(
                logprobs,
                old,
                mb["advantages"],
                0.2,
                0.2,
                sequence_mask=mb["mask"],
                seq_ids=mb.get("seq"),
                cp_group=cp_group,
            )
            return aggregate_loss(
                per_token,
                mb["mask"],
                "seq_mean_token_mean",
                num_seqs=len(samples),
                seq_ids=mb.get("seq"),
                seq_counts=mb.get("seq_counts"),
            )

        lp_pad, grad_pad = score(model, padded, batch, gspo_loss, logprobs_of, info)
        lp_pack, grad_pack = score(model, packed, batch, gspo_loss, logprobs_of, info)
        gathered = {}
        if spec.moe is not None and args.ep > 1:  # the all-gather dispatcher: passes of equal token counts
            ag_chunks = build_model(
                spec, dtype=torch.float32, moe_aux_loss_coef=0.0, moe_token_dispatcher_type="allgather", **layout
            )
            load_hf_weights(ag_chunks, spec, hf_dir)
            ag_model, _, _ = setup_training(ag_chunks, lr=0.0, use_distributed_optimizer=False)
            for pack in (False, True):
                mbs = B.micro_batches(
                    batch,
                    rows,
                    4,
                    length_multiple=multiple,
                    same_length=args.pp > 1,
                    max_tokens=64,
                    pack=pack,
                    same_count_group=peers,
                    same_tokens=True,
                    sample_multiple=sample_multiple,
                )
                gathered[pack] = score(ag_model, mbs, batch, gspo_loss, logprobs_of, info) + (mbs,)
        # negative control: the same packed rows as ONE sequence each (attention across samples, RoPE
        # positions running on): the comparison must see it
        merged = [
            dict(
                mb,
                cu_seqlens=torch.tensor([0, mb["tokens"].shape[1]], dtype=torch.int32),
                max_seqlen=mb["tokens"].shape[1],
            )
            for mb in packed
        ]
        lp_merged, _ = score(model, merged, batch, gspo_loss, logprobs_of, info)
        mask = batch["mask"].bool()
        result = dict(
            logprob_diff=float((lp_pad - lp_pack)[mask].abs().max()),
            control_diff=float((lp_pad - lp_merged)[mask].abs().max()),
            logprob_max=float(lp_pad[mask].abs().max()),
            grad_diff=float((grad_pad - grad_pack).abs().max()),
            grad_max=float(grad_pad.abs().max()),
            padded_tokens=sum(mb["tokens"].numel() for mb in padded),
            packed_tokens=sum(mb["tokens"].numel() for mb in packed),
        )
        if gathered:
            result.update(
                allgather_logprob_diff=max(float((lp_pad - lp)[mask].abs().max()) for lp, _, _ in gathered.values()),
                allgather_grad_diff=max(float((grad_pad - g).abs().max()) for _, g, _ in gathered.values()),
                # the ranks' token counts per pass: equal in the group (each rank reports its own)
                allgather_tokens=[[mb["tokens"].numel() for mb in mbs] for _, _, mbs in gathered.values()],
                plain_tokens=[mb["tokens"].numel() for mb in padded],
            )  # without same_tokens
        if args.critic:
            critic_chunks = build_critic(spec, dtype=torch.float32, moe_aux_loss_coef=0.0, **layout)
            load_critic_weights(critic_chunks, spec, hf_dir)
            head = getattr(critic_chunks[-1], "output_layer", None)  # (last stage) zero-initialised: randomise
            if head is not None:
                with torch.no_grad():
                    head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(3)))
            critic, _, _ = setup_training(critic_chunks, lr=0.0, use_distributed_optimizer=False)

            def values_of(mb, values):
                return values.squeeze(-1).float()

            def value_loss(mb, values):
                return aggregate_loss(
                    (values_of(mb, values) - 0.5) ** 2, mb["mask"], "token_mean", num_tokens=batch["mask"].sum()
                )

            v_pad, g_pad = score(critic, padded, batch, value_loss, values_of, info)
            v_pack, g_pack = score(critic, packed, batch, value_loss, values_of, info)
            result.update(
                value_diff=float((v_pad - v_pack)[mask].abs().max()),
                value_grad_diff=float((g_pad - g_pack).abs().max()),
                value_grad_max=float(g_pad.abs().max()),
            )
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, result)
        lists = ("allgather_tokens", "plain_tokens")
        results[name] = {k: max(r[k] for r in every) for k in result if k not in lists}
        if "allgather_tokens" in result:  # the all-gather's equal sizes, where the plain passes' differ
            results[name].update({f"{k}_equal": all(r[k] == result[k] for r in every) for k in lists})
        if info.rank == 0:
            print(name, results[name], flush=True)
    return results


if __name__ == "__main__":
    from tests.layouts import main

    main(parse_layout, run_layout)
