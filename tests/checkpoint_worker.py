"""Worker for tests/test_train_checkpoint.py (gloo, CPU). Two modes:

    torchrun --nproc_per_node 2 tests/checkpoint_worker.py train --hf-dir D --root R --root-full F --out A.json
        5 Adam steps at DP=2 from the HF weights (the uninterrupted run). Saves a training
        checkpoint into R (dp_reshardable, keep_last=2) after steps 2, 3 and 4, and into F
        (fully_reshardable) after step 3. Records losses, grad norms, LRs and, after the
        step-3 save, a fingerprint of every rank's RNG states.
    torchrun --nproc_per_node N tests/checkpoint_worker.py resume --root R --tp T --out B.json [--break-copy C]
    python tests/checkpoint_worker.py resume ...          (a single plain process: DP=1)
        Fresh model from the HF weights, load_training_checkpoint(R), then the remaining steps
        up to 5. With --break-copy: copy R to C, damage every checkpoint in it (the newest
        structurally, the older one so that only the load itself fails) and record the error.
    --critic (both modes): also train a PPO critic (common/critic.py build_critic, its own Adam
        and schedule) on the same batches, saved and loaded as extra_models={"critic": ...};
        resume --no-critic-root R2 first tries R2 (written without a critic) and records the error.

Every step draws its batch from the global python, numpy and torch RNGs, so the losses
after a resume only match if those RNG states were restored.
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.distributed as dist

TOTAL_STEPS, GLOBAL_BATCH, SEQ_LEN = 5, 4, 16


def train_step(ddp_chunks, optimizer, scheduler, vocab_size, critic=None):
    """One optimizer step on a random global batch of GLOBAL_BATCH sequences; returns
    (global mean loss, grad norm, lr used). Every rank draws the same global batch.
    critic: (ddp_chunks, optimizer, scheduler) of a value model, also stepped on the batch
    (regressing V(t) onto (token % 7) / 7); then (loss, grad norm, lr) of the critic follow."""
    from megatron.core import parallel_state as mpu

    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN))  # torch RNG
    order = list(range(GLOBAL_BATCH))
    random.shuffle(order)  # python RNG
    shift = int(np.random.randint(0, SEQ_LEN))  # numpy RNG
    tokens = torch.roll(tokens[order], shift, dims=1)
    dp_size, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    local = tokens.chunk(dp_size)[dp_rank]  # (GLOBAL_BATCH/dp, T)
    positions = torch.arange(SEQ_LEN).unsqueeze(0)

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        per_token_loss = model(ids, positions, None, labels=torch.roll(ids, -1, 1))  # (1, T)

        def loss_func(output):
            loss = output.float().mean()
            # clone: megatron divides the returned loss by num_microbatches in place
            return loss, {"loss": loss.detach().clone()}

        return per_token_loss, loss_func

    result = optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local)
    if critic is None:
        return result
    return result + critic_step(*critic, local, positions)


def critic_step(ddp_chunks, optimizer, scheduler, local, positions):
    """One step of the value model: V(t) regressed onto (token % 7) / 7."""

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        values = model(ids, positions, None).squeeze(-1)  # (1, T)

        def loss_func(output):
            loss = ((output - (ids % 7) / 7.0) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return values, loss_func

    return optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local)


def optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local):
    """forward/backward of this rank's micro-batches (one sequence each), one optimizer and
    scheduler step; returns (global mean loss, grad norm, lr used)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(local.split(1)), model=ddp_chunks,
        num_microbatches=local.shape[0], seq_length=SEQ_LEN, micro_batch_size=1, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    loss = torch.stack([entry["loss"] for entry in losses]).mean()
    dist.all_reduce(loss, group=mpu.get_data_parallel_group())
    return loss.item() / mpu.get_data_parallel_world_size(), float(grad_norm), lr


def rng_fingerprints():
    """(global generators, megatron tracker) digests of this rank's RNG states; reads only."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    numpy_state = np.random.get_state()
    glob = hashlib.sha256(repr(random.getstate()).encode())
    glob.update(numpy_state[1].tobytes() + repr(numpy_state[2:]).encode())
    glob.update(torch.get_rng_state().numpy().tobytes())
    tracker = hashlib.sha256()
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        tracker.update(name.encode() + state.numpy().tobytes())
    return glob.hexdigest()[:16], tracker.hexdigest()[:16]


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--root", required=True, help="training checkpoint root (dp_reshardable)")
    ap.add_argument("--root-full", help="train: second root, fully_reshardable, saved after step 3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--break-copy", help="resume: copy --root here and damage all of it")
    ap.add_argument("--critic", action="store_true", help="also train and checkpoint a critic")
    ap.add_argument("--no-critic-root", help="resume --critic: first try this root, saved without a critic")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common.train_checkpoint import load_training_checkpoint, save_training_checkpoint
    from common.dist import destroy_distributed, init_distributed
    from common.critic import build_critic, load_critic_weights
    from common.model import build_model, load_hf_spec, load_hf_weights
    from common.training import setup_training

    info = init_distributed(tp=args.tp, seed=1234)
    spec = load_hf_spec(args.hf_dir)
    chunks = build_model(spec, tp=info.tp_size)
    load_hf_weights(chunks, spec, args.hf_dir)
    # warmup + cosine decay: a scheduler that is not restored gives a different LR.
    # clip_grad high enough never to clip: megatron 0.16.1 leaves TP-sharded weights built
    # with perform_initialization=False without their tensor_model_parallel attribute, so
    # the grad norm (not the grads) is wrong at TP>1 and clipping would differ from TP=1.
    ddp_chunks, optimizer, scheduler = setup_training(
        chunks, lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=10, decay_style="cosine", clip_grad=1e3)
    result = {"losses": {}, "grad_norms": {}, "lrs": {}}
    critic, extra_models = None, None
    if args.critic:
        critic_chunks = build_critic(spec, tp=info.tp_size)
        load_critic_weights(critic_chunks, spec, args.hf_dir)
        # another schedule than the policy's, so a scheduler mix-up shows in the LRs
        critic = setup_training(critic_chunks, lr=3e-2, min_lr=0.0, warmup_steps=1, total_steps=8,
                                decay_style="linear", clip_grad=1e3)
        extra_models = {"critic": critic}
        result.update(critic_losses={}, critic_grad_norms={}, critic_lrs={})

    first_step = 1
    if args.mode == "resume":
        # perturb every RNG so that only a restore can bring back the saved states
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        if args.no_critic_root:
            try:
                load_training_checkpoint(args.no_critic_root, ddp_chunks, optimizer, scheduler,
                                         extra_models=extra_models)
                result["no_critic_error"] = None
            except RuntimeError as e:
                result["no_critic_error"] = str(e)
        extra = load_training_checkpoint(args.root, ddp_chunks, optimizer, scheduler, extra_models=extra_models)
        result["extra"] = extra
        result["rng_after_load"] = gather(rng_fingerprints())
        first_step = extra["step"] + 1

    for step in range(first_step, TOTAL_STEPS + 1):
        out = train_step(ddp_chunks, optimizer, scheduler, spec.vocab_size, critic)
        result["losses"][step], result["grad_norms"][step], result["lrs"][step] = out[:3]
        if critic is not None:
            result["critic_losses"][step], result["critic_grad_norms"][step], result["critic_lrs"][step] = out[3:]
        if args.mode == "train" and step in (2, 3, 4):
            extra = {"step": step, "samples_seen": step * GLOBAL_BATCH}
            save_training_checkpoint(args.root, step, ddp_chunks, optimizer, scheduler, extra, keep_last=2,
                                     meta={"written_by": "tests/checkpoint_worker.py"}, extra_models=extra_models)
            if step == 3:
                if args.root_full:
                    save_training_checkpoint(args.root_full, step, ddp_chunks, optimizer, scheduler, extra,
                                             keep_last=1, optimizer_sharding="fully_reshardable")
                result["rng_after_save"] = gather(rng_fingerprints())

    if args.break_copy:
        # Every checkpoint damaged: the newest one (already missing a file) structurally, the
        # older one so that its files look complete but the load itself fails.
        if info.rank == 0:
            shutil.copytree(args.root, args.break_copy)
            step3 = os.path.join(args.break_copy, "step_000003")
            size = os.path.getsize(os.path.join(step3, ".metadata"))
            with open(os.path.join(step3, ".metadata"), "wb") as f:
                f.write(b"\0" * size)
        dist.barrier()
        try:
            load_training_checkpoint(args.break_copy, ddp_chunks, optimizer, scheduler)
            result["all_damaged_error"] = None
        except RuntimeError as e:
            result["all_damaged_error"] = str(e)
        result["all_damaged_errors_agree"] = len(set(gather(result["all_damaged_error"]))) == 1

    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":  # dist_checkpointing's writer re-imports __main__
    main()
