"""Environments of agentic (multi-turn) episodes: what answers the model's turns, as plain Python.

    base.py        the interface: Environment (reset(item) -> first messages, step(text) -> Step) and Step
    tool_calls.py  Hermes/Qwen `<tool_call>{json}</tool_call>` blocks parsed and run; a malformed call is an
                   error observation the model reads, never a crash
    chat.py        token-in token-out: an observation's ids as the chat template renders the continuation
                   after the ids the model sampled (never re-tokenising the model's own turns)
    game.py        the built-in guessing game with feedback (the embedded tiny model learns it on a CPU)
    python_math.py the built-in Python interpreter for math: model-written code runs in the sandbox
    sandbox.py     run_python: untrusted code in a separate, limited process (docs/sandbox.md)
    sandbox_child.py  the sandbox's side inside that process (standard library only)

The episode driver that runs many episodes on a rollout engine is common/rollout/episodes.py.
May import common.rl, the standard library, torch and transformers (not common.rollout, common.train,
common.model or common.run).
"""
