"""What the entry scripts share, by concern. Imports point down these layers, never up or sideways:

    run/      flags, preflight checks, data and hub ids, logging and plots, distributed set-up
    train/    optimizer and DDP set-up, megatron's schedule, memory phases (offload), checkpoints, run safety
    rollout/  rollout engines behind one interface (vLLM on GPUs, the HF engine on CPUs), evaluation, agentic episodes
    env/      environments of agentic episodes: the interface, tool calls, chat-template bookkeeping, built-ins
    model/    the HF <-> Megatron bridge, GPTModel building, attention and MoE kernels, weight import/export
    rl/       pure math: logprobs, advantages, losses, batches and packing, rewards

run may import train, rollout, env, model and rl; train and rollout import model and rl (not each other);
rollout also imports env; env imports rl only; model imports rl; rl imports nothing of the project.
"""
