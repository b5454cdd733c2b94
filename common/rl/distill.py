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
of the teacher, no vocabulary-sized tensor kept); the full or top-k reverse KL per position would
need the student's and the teacher's distributions over the vocabulary at every token.
"""

import torch


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
