"""What both training loops do the same way within a step, out of the loop's way: this rank's micro-batches of
the step's batch, the teacher's scores of every sampled token, the step's checkpoint.

    StepBatches(batch, args, ...)   .of(order, m): this rank's micro-batches of mini-batch m (the update);
                                    .forward_only(): all of this rank's rows at the forward-only sizes
    teacher_pass(teacher, ..., batch, ...)   on-policy distillation: the teacher's logprobs (+ top-K) into batch
    StepCheckpoints(writer, args, ...)       .save(step, ...): the background save at a step's end
"""

import os
import time

import torch

from common.rl import batch as B
from common.rl.distill import vocab_parallel_topk
from common.rl.logprobs import vocab_parallel_logprobs
from common.run import flags as F
from common.train.passes import forward_pass


class StepBatches:
    """This rank's micro-batches of a step's batch (common/rl/batch.py micro_batches): mini-batch m of a row
    order, DP rank d -> a contiguous slice of it; rows ordered by length, each micro-batch cut after its longest
    row (one length for all with a pipeline): padding costs no FLOPs, the losses are unchanged."""

    def __init__(self, batch, args, info, layout, *, mini_batch, rollout_batch):
        self.batch, self.args, self.mini_batch, self.rollout_batch = batch, args, mini_batch, rollout_batch
        self.per_dp = mini_batch // info.dp_size  # samples of one mini-batch on one data-parallel rank (divides)
        self.dp_rank, self.layout = info.dp_rank, layout  # build.pass_layout: the passes' groups, length multiples

    def of(self, order, m, sizes=None):
        """Mini-batch m of order (a permutation of the rows) on this rank; sizes: (samples, tokens) per
        micro-batch, default --micro-batch-size and --micro-batch-tokens."""
        args, layout = self.args, self.layout
        sizes = sizes or (args.micro_batch_size, args.micro_batch_tokens)
        rows = order[m * self.mini_batch + self.dp_rank * self.per_dp :][: self.per_dp]
        return B.micro_batches(
            self.batch,
            rows,
            sizes[0],
            length_multiple=layout.multiple,
            same_length=args.pp > 1,
            max_tokens=sizes[1],
            pack=args.pack,
            same_count_group=layout.expert_peers,  # (all-to-all in every pass)
            same_tokens=args.moe_dispatcher == "allgather",  # (its all-gather: equal sizes)
            sample_multiple=layout.sample_multiple,
        )

    def forward_only(self):
        """Every mini-batch's rows in their order, at the forward-only passes' sizes (--logprob-micro-batch-*);
        called again after the batch gains routes (--routing-replay old), the micro-batches carry them."""
        identity = torch.arange(len(self.batch["tokens"]))
        sizes = F.logprob_micro_batching(self.args)
        return [mb for m in range(self.rollout_batch // self.mini_batch) for mb in self.of(identity, m, sizes)]


def teacher_pass(teacher, teacher_spec, mbs, batch, args, tp_group, device):
    """On-policy distillation: the frozen teacher's logprob of every sampled token (at --temperature) into
    batch["teacher_logprobs"] (N, T), on every rank; --distill-topk K: also its top-K logprobs and ids at every
    position, batch["teacher_topk_logprobs"] / ["teacher_topk_ids"] (N, T, K), in the teacher's own vocabulary.
    The micro-batches lose the policy's routes (--routing-replay): the teacher routes its own way."""
    num_rows, seq_len = batch["tokens"].shape
    topk, temperature, vocab_size = args.distill_topk, args.temperature, teacher_spec.vocab_size

    def scores_of(mb, logits):  # (b, T, 1 + 2K): the sampled token's logprob | top-K logprobs | ids
        scores = [vocab_parallel_logprobs(logits, mb["targets"], vocab_size, tp_group, temperature)[0].unsqueeze(-1)]
        if topk:  # the global top-K over the TP vocabulary shards (ids < 2**24: exact as floats)
            values, ids = vocab_parallel_topk(logits, topk, vocab_size, tp_group, temperature)
            scores += [values, ids.float()]
        return torch.cat(scores, dim=-1)

    scores = torch.zeros(num_rows, seq_len, 1 + 2 * topk)
    own_routes = [{k: v for k, v in mb.items() if k != "routes"} for mb in mbs]
    forward_pass(teacher, own_routes, scores_of, scores, device=device)
    batch["teacher_logprobs"] = scores[..., 0]
    if topk:
        topk_logprobs, topk_ids = scores[..., 1:].split(topk, dim=-1)
        batch["teacher_topk_logprobs"], batch["teacher_topk_ids"] = topk_logprobs, topk_ids.long()


class StepCheckpoints:
    """The loop's checkpoints: at a step's end, a save written in the background (common/train/save.py
    CheckpointWriter) under <out>/checkpoints, with what a resume needs besides the models: the prompt
    sampler's position, the schedule flags, --off-policy-steps' samples in flight (carry), and a description
    (architecture, dtype; with LoRA the base its adapters are trained on: merge_to_hf.py loads it from there).
    extra_models, before_model: CheckpointWriter.save's (PPO's critic, its optimizer turn)."""

    def __init__(self, writer, args, *, spec, dtype, sampler, carry, hf_dir, extra_models=None, before_model=None):
        self.writer, self.args, self.sampler, self.carry = writer, args, sampler, carry
        self.hf_dir, self.extra_models, self.before_model = hf_dir, extra_models, before_model
        self.root = os.path.join(args.out, "checkpoints")
        self.meta = {"architecture": spec.architecture, "dtype": str(dtype)}
        if args.lora:
            self.meta["lora"] = dict(args.lora, base=args.model or hf_dir, base_mcore=args.mcore_ckpt)

    def save(self, step, model, optimizer, scheduler, times, metrics):
        """Checkpoint `step` (the number of steps done); times["save_s"]: what the loop waited (checks,
        planning, copies to host memory); metrics["save_wait_sec"]: of that, the previous save's files."""
        tick, args = time.time(), self.args
        self.writer.save(
            self.root,
            step,
            model,
            optimizer,
            scheduler,
            extra={
                "step": step,
                "sampler": self.sampler.state_dict(),
                "flags": F.schedule_flags(args),
                **({"partial": self.carry.state_dict()} if self.carry else {}),  # in flight: continued on resume
            },
            keep_last=args.keep_checkpoints,
            extra_models=self.extra_models,
            hf_source_dir=self.hf_dir,  # + hf/: merge_to_hf.py
            meta=dict(self.meta, step=step),
            optimizer_sharding="fully_reshardable" if args.save_any_layout else "dp_reshardable",
            before_model=self.before_model,
        )
        times["save_s"] = time.time() - tick
        metrics["save_wait_sec"] = self.writer.wait_s
