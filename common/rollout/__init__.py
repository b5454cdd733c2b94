"""Sampling responses from the current policy, with per-token logprobs, and evaluation.

    engine.py         the engine interface (RolloutEngine, Sample) and the logprob checks of a rollout
    hf_engine.py      the CPU engine: transformers with a batched sampling loop
    vllm_engine.py    vLLM colocated in the torchrun processes (GPUs); in-place weight updates
    vllm_turns.py     its agentic path: turns of episodes as vLLM requests, one by one
    vllm_experts.py   its sync's copies of routed experts into vLLM's fused MoE parameters
    engines.py        make_engine: which engine a run gets
    routes.py         the MoE routes of a rollout: router hooks on the CPU engine, vLLM's routed experts
    lengths.py        a benchmark's response lengths, drawn from a distribution (fixed, uniform, lognormal)
    weight_replay.py  a weight loader's writes recorded once and replayed each sync
    evaluate.py       validation: greedy or sampled answers on held-out prompts, scored
    episodes.py       agentic episodes: many multi-turn episodes at once on an engine, token-in token-out
    partial.py        --off-policy-steps: partial rollouts carried between steps, per-token versions, staleness bound
    remote.py         --rollout-gpus: engines on ranks of their own, the trainer's requests and weights sent to them
    ahead.py          --rollout-gpus --off-policy-steps 1: whole requests sent a step ahead to those engines
    stream.py         --rollout-gpus with --partial-chunk-tokens: partial rollouts streaming on those engines

May import common.env, common.model and common.rl (not common.train or common.run).
"""
