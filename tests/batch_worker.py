"""Worker of tests/test_batch.py: the same logprobs and gradients with padding cut; and
train_step's optimizer against Adam written out by hand.

    python tests/batch_worker.py HF_DIR          # padding cut
    python tests/batch_worker.py HF_DIR adam     # two optimizer steps
    python tests/batch_worker.py HF_DIR[,HF_DIR...] wgrad     # fused weight-gradient accumulation vs megatron's
    python tests/batch_worker.py HF_DIR[,HF_DIR...] dispatch  # MoE: tokens sorted on the device vs megatron's

A tiny Qwen2 (fp32) scores a batch of samples of very different lengths twice: micro-batches
at the batch's full width (split_micro_batches) and length-sorted micro-batches cut after
their longest row (micro_batches). Prints JSON: max |logprob difference| on response tokens,
max |gradient difference| of the token-mean loss, and the tokens each way processed.
In `adam` mode: setup_training's optimizer (distributed, fp32) takes two train_step's and
each parameter is compared with AdamW computed here from the same gradients (the DDP
buffer's main_grad): decoupled weight decay on matrices only (megatron's default: none on
biases and norms), bias-corrected moments. Prints whether torch's fused kernel was on and
the largest |difference| over all parameters.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_model(hf_dir, dtype=torch.float32):
    """(spec, model chunks with the HF weights), in a world of one process."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    spec = load_hf_spec(hf_dir)
    chunks = build_model(spec, dtype=dtype)
    load_hf_weights(chunks, spec, hf_dir)
    return spec, chunks


def main():
    from common.rl import batch as B
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss
    from common.rollout.engine import Sample
    from common.train import schedule
    from common.train.setup import setup_training

    spec, chunks = tiny_model(sys.argv[1])
    model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=False)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(12):  # responses of 1 to 40 tokens: widths from 8 to 48 after rounding
        p, r = 2 + i % 4, 1 + (i * 7) % 40
        ids = torch.randint(3, spec.vocab_size, (p + r,), generator=gen).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * r, "stop"))
    batch = B.pack_sequences(samples, pad_id=0, length_multiple=8)
    batch["row"] = torch.arange(len(samples))
    num_tokens = batch["mask"].sum()

    def run(mbs):
        store = torch.zeros_like(batch["mask"])

        def loss_fn(mb, logits):
            logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            store[mb["row"], : logprobs.shape[1]] = logprobs.detach()
            loss = aggregate_loss(-logprobs, mb["mask"], "token_mean", num_tokens=num_tokens)
            return loss * len(mbs), {}

        for chunk in model:
            chunk.zero_grad_buffer()
        schedule.run_micro_batches(model, mbs, loss_fn, forward_only=False, device=torch.device("cpu"))
        grads = torch.cat([p.main_grad.flatten().clone() for p in model[0].parameters()])
        return store, grads, sum(mb["tokens"].numel() for mb in mbs)

    full_lp, full_grad, full_tokens = run(B.split_micro_batches(batch, 4))
    cut_lp, cut_grad, cut_tokens = run(B.micro_batches(batch, torch.arange(len(samples)), 4, length_multiple=8))
    mask = batch["mask"].bool()
    print(
        "RESULT "
        + json.dumps(
            dict(
                logprob_diff=float((full_lp - cut_lp)[mask].abs().max()),
                grad_diff=float((full_grad - cut_grad).abs().max()),
                grad_max=float(full_grad.abs().max()),
                full_tokens=full_tokens,
                cut_tokens=cut_tokens,
                width=batch["tokens"].shape[1],
            )
        )
    )


def adam(clip_grad=0.0):
    """Two steps of setup_training's optimizer against Adam by hand; clip_grad > 0: with
    gradients clipped to that total norm (common/train/setup.py's foreach multiply)."""
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule
    from common.train.setup import setup_training, torch_adams

    spec, chunks = tiny_model(sys.argv[1])
    lr, weight_decay, (beta1, beta2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    model, optimizer, scheduler = setup_training(
        chunks, lr=lr, weight_decay=weight_decay, adam_betas=(beta1, beta2), adam_eps=eps, clip_grad=clip_grad
    )
    fused = all(g["fused"] for adam in torch_adams(optimizer) for g in adam.param_groups)
    named = list(model[0].named_parameters())
    expected = {n: p.detach().clone() for n, p in named}
    m = {n: torch.zeros_like(p) for n, p in named}
    v = {n: torch.zeros_like(p) for n, p in named}
    gen = torch.Generator().manual_seed(1)
    errors, norm_errors, clipped = [], [], []
    for t in (1, 2):
        tokens = torch.randint(3, spec.vocab_size, (2, 16), generator=gen)
        mb = dict(tokens=tokens, positions=torch.arange(16).expand(2, 16), targets=tokens.roll(-1, 1))

        def loss_fn(mb, logits):
            logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            return -logprobs.mean(), {}

        _, grad_norm = schedule.train_step(model, optimizer, scheduler, [mb], loss_fn, device=torch.device("cpu"))
        # the step clipped main_grad in place (if at all): its norm is then grad_norm * coeff
        by_hand = sum(float(p.main_grad.double().square().sum()) for _, p in named) ** 0.5
        coeff = min(1.0, clip_grad / (grad_norm + 1e-6)) if clip_grad > 0 else 1.0
        norm_errors.append(abs(grad_norm * coeff - by_hand) / by_hand)
        clipped.append(coeff < 1.0)
        for n, p in named:
            g = p.main_grad  # the gradient the update used
            m[n] = beta1 * m[n] + (1 - beta1) * g
            v[n] = beta2 * v[n] + (1 - beta2) * g * g
            decay = 0.0 if n.endswith(".bias") or p.dim() == 1 else weight_decay
            update = (m[n] / (1 - beta1**t)) / ((v[n] / (1 - beta2**t)).sqrt() + eps)
            expected[n] = expected[n] * (1 - lr * decay) - lr * update
            errors.append(float((p.detach() - expected[n]).abs().max()))
    print(
        "RESULT "
        + json.dumps(
            dict(
                fused=fused,
                max_err=max(errors),
                params=len(named),
                grad_norm_rel_err=max(norm_errors),
                optimizer=type(optimizer).__name__,
                clip_grad=clip_grad,
                clipped=clipped,
            )
        )
    )


def listed_copies():
    """A bf16 model's optimizer step with common/train/setup.py's listed copies, then megatron's own
    two copies run again on the same optimizer: they must find each main shard's grad already the
    same view of DDP's buffer, and each bf16 parameter already the same bits."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule
    from common.train.setup import setup_training

    spec, chunks = tiny_model(sys.argv[1], dtype=torch.bfloat16)
    model, optimizer, scheduler = setup_training(chunks, lr=1e-2, clip_grad=1.0, listed_copies=True)
    tokens = torch.randint(3, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    mb = dict(tokens=tokens, positions=torch.arange(16).expand(2, 16), targets=tokens.roll(-1, 1))
    before = [p.detach().clone() for p in model[0].parameters()]

    def loss_fn(mb, logits):
        return -vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)[0].float().mean(), {}

    schedule.train_step(model, optimizer, scheduler, [mb], loss_fn, device=torch.device("cpu"))
    after = [p.detach().clone() for p in model[0].parameters()]
    inner = optimizer.chained_optimizers
    ours = [[(m.grad.data_ptr(), m.grad.shape, m.grad.stride()) for m in opt._copy_lists[0]] for opt in inner]
    for opt, listed in zip(inner, ours):
        DistributedOptimizer._copy_main_params_to_model_params(opt)
        DistributedOptimizer._copy_model_grads_to_main_grads(opt)
        assert [(m.grad.data_ptr(), m.grad.shape, m.grad.stride()) for m in opt._copy_lists[0]] == listed
    print(
        "RESULT "
        + json.dumps(
            dict(
                listed=[type(opt).__name__ for opt in inner],
                shards=sum(len(x) for x in ours),
                changed=sum(not torch.equal(a, b) for a, b in zip(before, after)),
                params=len(after),
                megatron_differs=sum(not torch.equal(a, p) for a, p in zip(after, model[0].parameters())),
            )
        )
    )


def wgrad(hf_dir):
    """Weight gradients accumulated inside the GEMM (common/train/setup.py fuse_wgrad_accumulation)
    against megatron's own path (a weight gradient, then DDP's hook adds it), over three
    micro-batches so the accumulation itself is compared, for fp32 and bf16 models. For an MoE
    model the grouped experts' per-layer accumulation (common/model/moe_experts.py) too, compared exactly."""
    from common.model import linear
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule
    from common.train.setup import fuse_wgrad_accumulation, setup_training

    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        spec, chunks = tiny_model(hf_dir, dtype)
        model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=False)
        gen = torch.Generator().manual_seed(2)
        mbs = []
        for _ in range(3):
            tokens = torch.randint(3, spec.vocab_size, (2, 16), generator=gen)
            mbs.append(dict(tokens=tokens, positions=torch.arange(16).expand(2, 16), targets=tokens.roll(-1, 1)))

        def loss_fn(mb, logits):
            logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            return -logprobs.float().mean(), {}

        grads = {}
        # (fused wgrad accumulation, QKV bias in the GEMM: common/model/linear.py); megatron's path is (False, False)
        for fused, bias_in_gemm in ((False, False), (True, True), (True, False)):
            layers = fuse_wgrad_accumulation(model, enabled=fused)
            linear.ENABLED = bias_in_gemm
            for chunk in model:
                chunk.zero_grad_buffer()
            schedule.run_micro_batches(
                model, mbs, loss_fn, forward_only=False, device=next(model[0].parameters()).device
            )
            grads[fused, bias_in_gemm] = {n: p.main_grad.clone() for n, p in model[0].named_parameters()}
        linear.ENABLED = True

        def rel_err(a, b):
            return {n: float((grads[a][n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in grads[b].items()}

        rel = rel_err((True, False), (False, False))
        bias_rel = rel_err((True, True), (True, False))
        if dtype == torch.float32:
            exact = grads[False, False]
        # each bf16 path's distance from the fp32 gradients (the same HF weights): the bias in the GEMM
        # rounds the QKV output once instead of twice, so its gradients must not be further from them
        from_fp32 = {
            key: max(
                float((g.float() - exact[n]).norm() / exact[n].norm().clamp(min=1e-30)) for n, g in grads[key].items()
            )
            for key in ((True, True), (True, False))
        }
        bias_layers = sum(isinstance(m, linear.BiasInGemmColumnParallelLinear) for m in model[0].modules())
        experts = {
            n: float((grads[True, False][n] - g).abs().max())
            for n, g in grads[False, False].items()
            if ".local_experts." in n
        }
        result[str(dtype).split(".")[-1]] = dict(
            layers=layers,
            device=str(next(model[0].parameters()).device),
            params=len(rel),
            max_rel_err=max(rel.values()),
            worst=max(rel, key=rel.get),
            tied=spec.tie_word_embeddings,
            expert_params=len(experts),
            experts_max_abs_diff=max(experts.values(), default=None),
            experts_nonzero=sum(bool(grads[True, False][n].any()) for n in experts),
            bias_in_gemm_layers=bias_layers,
            bias_in_gemm_max_rel_err=max(bias_rel.values()),
            bias_in_gemm_from_fp32=from_fp32[True, True],
            bias_add_from_fp32=from_fp32[True, False],
        )
        if dtype == torch.float32 and experts:
            # MoE, with the distributed optimizer: its parameter buffer holds the expert weights evenly
            # spaced too, so the grouped GEMMs read them in place (common/model/moe_experts.py GroupedExperts.stacks)
            from common.model.moe_experts import GroupedExperts

            spec, chunks = tiny_model(hf_dir, dtype)
            model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=True)
            schedule.run_micro_batches(
                model, mbs, loss_fn, forward_only=False, device=next(model[0].parameters()).device
            )
            layers = [m for m in model[0].modules() if isinstance(m, GroupedExperts)]
            result["in_place"] = dict(
                layers=sum(all(m.stacks()[k] is not None for k in ("w1", "w2", "g1", "g2")) for m in layers),
                descending=sorted({m.stacks()["descending"] for m in layers}),
                moe_layers=len(layers),
                experts_max_abs_diff=max(
                    float((p.main_grad - exact[n]).abs().max())
                    for n, p in model[0].named_parameters()
                    if ".local_experts." in n
                ),
            )
    print("RESULT " + json.dumps(dict(result, model=os.path.basename(hf_dir))))


def dispatch(hf_dir):
    """MoE layers' tokens sorted by expert on the device (common/model/moe.py DeviceSortDispatcher) and
    routed by common/model/moe_router.py's routing (compiled on a GPU) against megatron's all-gather
    dispatcher and routing, same weights and tokens (fp32), a padded tail in the batch: the loss,
    every gradient (the permutation, the probs, the combine and the aux losses both ways) and
    the aux losses megatron's tracker logged."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule
    from common.train.setup import fuse_wgrad_accumulation, setup_training

    spec, chunks = tiny_model(hf_dir)
    model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=False)
    fuse_wgrad_accumulation(model, enabled=False)  # autograd's gradients both ways
    layers = [layer.mlp for layer in model[0].module.decoder.layers if hasattr(layer.mlp, "token_dispatcher")]
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, spec.vocab_size, (2, 24), generator=gen)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, 17:] = False  # a padded tail: the routers' padding_mask
    mb = dict(tokens=tokens, positions=torch.arange(24).expand(2, 24), targets=tokens.roll(-1, 1), valid=valid)

    def loss_fn(mb, logits):
        logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
        loss = -logprobs.float().mean()
        return loss, {"loss": loss.detach()}

    runs = {}
    for name in ("ours", "megatron"):
        runs[name + "_dispatchers"] = sorted({type(layer.token_dispatcher).__name__ for layer in layers})
        for chunk in model:
            chunk.zero_grad_buffer()
        metrics = schedule.run_micro_batches(
            model, [mb], loss_fn, forward_only=False, device=next(model[0].parameters()).device
        )
        runs[name] = (float(metrics[0]["loss"]), {n: p.main_grad.clone() for n, p in model[0].named_parameters()})
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        runs[name + "_aux"] = {key: tracker[key]["values"].tolist() for key in sorted(tracker)}
        moe_utils.clear_aux_losses_tracker()
        for layer in layers:  # megatron's own dispatcher and routing for the second run (same state, its methods)
            layer.token_dispatcher.__class__ = MoEAllGatherTokenDispatcher
            layer.router.compiled = False
    (loss, grads), (ref_loss, ref_grads) = runs.pop("ours"), runs.pop("megatron")
    diff = {n: float((grads[n] - g).abs().max()) for n, g in ref_grads.items()}
    print(
        "RESULT "
        + json.dumps(
            dict(
                runs,
                model=os.path.basename(hf_dir),
                moe_layers=len(layers),
                loss=loss,
                loss_diff=abs(loss - ref_loss),
                max_grad_diff=max(diff.values()),
                params=len(diff),
                experts_with_grads=sum(bool(g.any()) for n, g in grads.items() if ".local_experts." in n),
            )
        )
    )


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    if mode in ("wgrad", "dispatch"):  # HF_DIR may be several, comma-separated: one process, one RESULT each
        for hf_dir in sys.argv[1].split(","):
            {"wgrad": wgrad, "dispatch": dispatch}[mode](hf_dir)
    else:
        {"adam": lambda: [adam(clip) for clip in (0.0, 0.05)] + [listed_copies()]}.get(mode, main)()
