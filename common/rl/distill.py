"""On-policy distillation (OPD): the student samples, a frozen teacher scores every sampled token,
and the student minimises the per-token reverse KL to the teacher on its own samples.

    KL(pi_student || pi_teacher) = E_{y ~ pi_student} [ sum_t log pi_student(y_t|y<t) - log pi_teacher(y_t|y<t) ]

Its policy gradient with each token its own return (discount 0) (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes"; Thinking Machines' "On-Policy
Distillation", 2025) is the REINFORCE gradient with advantage

    A_t = coef * (log pi_teacher(y_t) - log pi_student(y_t))          (one sampled token, no future sum)

so distillation is one more per-token advantage term in the scripts' clipped policy loss: tokens the
teacher likes more than the student are pushed up, the others down. The student's logprob is the
behaviour policy's (the old logprobs, detached), as a constant of the advantage. No std
normalisation: the term is already in nats, and a group whose tokens all match the teacher has
nothing to learn. Only the sampled token is scored (one teacher logprob per token: a forward pass
of the teacher, no vocabulary-sized tensor kept).

With --distill-topk K the teacher's top-K tokens at every position replace the sampled-token term:
the teacher pass keeps their ids and logprobs (vocab_parallel_topk: the global top-K over the
tensor-parallel vocabulary shards), and a per-token loss pulls the student's distribution to the
teacher's over that support, the forward KL from the teacher renormalised over its top-K
(p_k = softmax of its K logprobs; 0 outside them) to the student's full distribution:

    KL_t = sum_k p_k (log p_k - log pi_student(v_k))                  (>= 0; 0 iff the student is p)

(GKD's forward-KL case, Agarwal et al. 2024, with the teacher truncated to its top K as distillation
pipelines store it.) The student's logprobs at the K ids need no second pass over the vocabulary:
log pi(v) = x_v - log Z, and log Z = x_y - log pi(y) for the sampled token y whose logprob the loss
already has, so log pi(v_k) = x_{v_k} - x_y + log pi(y) (topk_student_logprobs: K + 1 gathers).
"""

import torch
import torch.distributed as dist


def distill_advantages(teacher_logprobs, student_logprobs, mask, coef=1.0):
    """(N, T) per-token distillation advantages coef * (teacher - student) on the tokens of mask
    (response tokens), 0 elsewhere (padding may hold any logprob, even -inf). All (N, T);
    student_logprobs: the behaviour policy's, detached (the gradient flows through the loss's ratio)."""
    diff = teacher_logprobs - student_logprobs.detach()
    return torch.where(mask.bool(), coef * diff, torch.zeros_like(diff))


def reverse_kl_sum(teacher_logprobs, student_logprobs, mask):
    """Sum over the tokens of mask of log pi_student - log pi_teacher: divided by the token count, the
    sampled estimate of KL(student || teacher) per token (the metric distill_reverse_kl)."""
    diff = student_logprobs.detach() - teacher_logprobs
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).sum()


# -----------------------------------------------------------------------------
# --distill-topk: the teacher's top-K and the forward KL to it


def _tp_size_rank(tp_group):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def vocab_parallel_topk(logits, k, vocab_size, tp_group=None, temperature=1.0):
    """The global top-k of log_softmax(logits / temperature) over the first vocab_size columns of a
    vocabulary split over tp_group: logits (B, T, V_local), TP rank r holding columns [r V_local,
    (r + 1) V_local). Returns (logprobs (B, T, k) fp32, descending; ids (B, T, k) int64 global), the
    same on every rank. Each rank's own top-k (k of its columns) and log-sum-exp are all-gathered:
    the global top-k is among the tp x k candidates. All ranks of tp_group call this. No gradient."""
    tp_size, tp_rank = _tp_size_rank(tp_group)
    with torch.no_grad():
        v_local = logits.shape[-1]
        x = logits.float() / temperature  # (B, T, V_local)
        n_valid = max(0, min(v_local, vocab_size - tp_rank * v_local))  # [n_valid:]: vocabulary padding
        x[..., n_valid:] = float("-inf")
        values, ids = x.topk(min(k, v_local), dim=-1)  # (B, T, k_local)
        ids = ids + tp_rank * v_local
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (B, T, 1); -inf on an all-padding shard
        if tp_size > 1:
            parts = [torch.cat([values, ids.to(values.dtype), lse], dim=-1) for _ in range(tp_size)]
            dist.all_gather(parts, torch.cat([values, ids.to(values.dtype), lse], dim=-1), group=tp_group)
            kl = values.shape[-1]
            values = torch.cat([p[..., :kl] for p in parts], dim=-1)
            ids = torch.cat([p[..., kl : 2 * kl] for p in parts], dim=-1).long()  # exact below 2**24
            lse = torch.logsumexp(torch.cat([p[..., -1:] for p in parts], dim=-1), dim=-1, keepdim=True)
            values, at = values.topk(k, dim=-1)
            ids = ids.gather(-1, at)
        return values - lse, ids


class _ReduceFromShards(torch.autograd.Function):
    """Sum over the TP ranks forward; the gradient passes through as is (each rank's share of the
    sum is its own columns', and every rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x, tp_group):
        x = x.clone()
        dist.all_reduce(x, group=tp_group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_columns(logits, ids, tp_group):
    """logits[..., ids] of the global vocabulary from TP-sharded logits: (B, T, V_local), (B, T, k) ->
    (B, T, k) fp32, differentiable (each id's logit is on one rank; the others add 0)."""
    tp_size, tp_rank = _tp_size_rank(tp_group)
    v_local = logits.shape[-1]
    local = ids - tp_rank * v_local
    in_shard = (local >= 0) & (local < v_local)
    picked = logits.gather(-1, local.clamp(0, v_local - 1)).float() * in_shard
    return _ReduceFromShards.apply(picked, tp_group) if tp_size > 1 else picked


def topk_student_logprobs(logits, ids, targets, target_logprobs, tp_group=None, temperature=1.0):
    """The student's log pi(v) at the teacher's ids (B, T, k), differentiable w.r.t. logits, from the
    sampled tokens' logprobs target_logprobs (B, T; vocab_parallel_logprobs', differentiable):
    log pi(v) = (x_v - x_y) / temperature + log pi(y). All ranks of tp_group call this."""
    x = _gather_columns(logits, torch.cat([ids, targets.unsqueeze(-1)], dim=-1), tp_group) / temperature
    return x[..., :-1] - x[..., -1:] + target_logprobs.unsqueeze(-1)


def teacher_topk_kl(mb, logits, logprobs, tp_group=None, temperature=1.0):
    """--distill-topk's per-token loss term (B, T) of a micro-batch: topk_forward_kl of the teacher's top-K
    (mb["teacher_topk_logprobs"], mb["teacher_topk_ids"]) against the student's logprobs at those ids, from its
    logits and sampled tokens' logprobs (differentiable)."""
    student = topk_student_logprobs(logits, mb["teacher_topk_ids"], mb["targets"], logprobs, tp_group, temperature)
    return topk_forward_kl(mb["teacher_topk_logprobs"], student)


def topk_forward_kl(teacher_topk_logprobs, student_topk_logprobs):
    """(B, T) per-token KL(p || pi_student) with p the teacher renormalised over its top k:
    sum_k p_k (log p_k - log pi_student(v_k)); both (B, T, k)."""
    log_p = torch.log_softmax(teacher_topk_logprobs.float(), dim=-1)
    return (log_p.exp() * (log_p - student_topk_logprobs)).sum(-1)
