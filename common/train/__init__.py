"""The trainer's side of a step: set-up, the update, its memory phases, checkpoints and run safety.

    setup.py            megatron DDP (+ distributed optimizer), Adam, the LR schedule
    schedule.py         megatron's pipeline schedule over micro-batches; the update step
    passes.py           forward-only passes: per-token logprobs or values into the batch's rows
    colocation.py       the colocated step's memory choreography (what moves when), and its measurement
    offload.py          moving state to pinned host memory and back; host_pool.py: that memory, one block
    guard.py            what stops a run: signals, non-finite numbers, usage errors (exit codes 0/3/2)
    checkpoint.py       model checkpoints (dist_checkpointing), loadable at any layout
    save.py, resume.py  training checkpoints: the full state, written atomically / loaded at any layout
    checkpoint_io.py    their tensor files, written in the background
    checkpoint_dirs.py  their step directories and RNG files
    reward_model.py     an HF reward model as a frozen Megatron model

May import common.model and common.rl (not common.rollout or common.run).
"""
