"""Pure RL math on tensors: nothing here knows about models, engines or command-line flags.

    logprobs.py     log pi(token) and entropy from tensor-parallel logits, no vocabulary gather
    advantages.py   GRPO group advantages, GAE
    losses.py       the policy and value losses, their aggregation, KL estimators
    corrections.py  off-policy corrections of the engine's samples (TIS, IcePop, sequence masks, ...)
    batch.py        samples -> micro-batches (padded or packed), context-parallel slices
    dapo.py         DAPO's dynamic sampling
    distill.py      on-policy distillation: per-token teacher - student advantages, the reverse KL
    rewards.py      rule-based rewards (math answers)
    fused.py        torch.compile helpers for the elementwise kernels here and in common.model

Imports nothing of the project.
"""
