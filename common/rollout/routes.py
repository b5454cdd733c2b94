"""MoE routes of a rollout: the experts each token went to, per MoE layer (--routing-replay rollout).

    recorder = RouteRecorder(hf_model)      # forward hooks on a transformers model's MoE routers
    with recorder:
        model(...); recorder.step()         # after each forward: its (B, L) tokens' routes
    routes = recorder.routes()              # (B, all columns, M, k) int16
    routes_from_vllm(completion.routed_experts, moe_layers)   # vLLM's array -> (tokens, M, k) int16

A sample's routes (Sample.routes, common/rollout/engine.py) are (prompt + response - 1, M, k): the
top-k expert ids of every token the engine ran (the prompt, then each sampled token but the
last), in each of the model's M MoE layers in order, as the engine chose them (DeepSeek-V3: after
the score-correction bias and the group limit). The trainer replays them
(common/model/routing_replay.py).
"""

import torch


def _routers(model):
    """The MoE routers of a transformers 5 causal LM, in layer order: `mlp.gate` of each decoder layer
    whose MLP routes (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 call it so; every one returns
    (router logits, top-k weights, top-k expert ids)); dense layers have no such gate."""
    found = []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            found.append(gate)
    return found


class RouteRecorder:
    """Forward hooks on every MoE router of a transformers model, recording the expert ids it chose.

    Each model forward over (B, L) tokens (a prefill, or a decode step with L = 1) is followed by
    step(), which stacks that forward's (B * L, k) ids of each router into (B, L, M, k)."""

    def __init__(self, model):
        self.gates = _routers(model)
        if not self.gates:
            raise ValueError(f"{type(model).__name__} has no MoE routers to record routes of")
        self._calls, self._steps, self._hooks = [], [], []

    def __enter__(self):
        self._hooks = [gate.register_forward_hook(self._hook) for gate in self.gates]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _hook(self, module, args, output):
        self._calls.append(output[2])  # (tokens, k) the experts this router sent each token to

    def step(self, batch, length):
        """After a forward of `batch` rows x `length` tokens: its routes (B, L, M, k)."""
        if len(self._calls) != len(self.gates):
            raise RuntimeError(f"{len(self._calls)} router calls in a forward of {len(self.gates)} MoE layers")
        ids = torch.stack([c.reshape(batch, length, -1) for c in self._calls], dim=2)
        self._steps.append(ids.to(torch.int16).cpu())
        self._calls = []

    def routes(self):
        """(B, columns of all steps, M, k) int16, the forwards' tokens side by side."""
        return torch.cat(self._steps, dim=1)


def routes_from_vllm(routed_experts, moe_layers):
    """vLLM's CompletionOutput.routed_experts ((tokens, layers, k) integers, for prompt + response - 1
    tokens with enable_return_routed_experts) -> (tokens, M, k) int16 of the M MoE layers.

    vLLM sizes the layer axis by num_hidden_layers: an MoE layer's ids sit at its decoder index
    (dense layers never written), or the MoE layers come first in order; which one is read off
    the array: a layer vLLM wrote has k distinct experts per token, one it did not holds zeros.
    moe_layers: per decoder layer, whether it is MoE (the bridge's MoESpec.moe_layers)."""
    ids = torch.as_tensor(routed_experts).to(torch.int16)
    moe = [i for i, is_moe in enumerate(moe_layers) if is_moe]
    if ids.dim() != 3:
        raise ValueError(f"routed experts of shape {tuple(ids.shape)}: expected (tokens, layers, top-k)")
    if ids.shape[1] == len(moe):
        return ids
    if ids.shape[1] != len(moe_layers):
        raise ValueError(f"routed experts for {ids.shape[1]} layers; the model has {len(moe_layers)} ({len(moe)} MoE)")
    for candidate in (ids[:, moe], ids[:, : len(moe)]):
        if len(candidate) == 0 or _written(candidate):
            return candidate
    raise ValueError("routed experts: the MoE layers' ids are neither at their decoder indices nor first")


def _written(ids):
    """Whether every token of every layer of (tokens, M, k) has k distinct experts (k > 1); with
    k = 1 no distinction can be made: taken as written."""
    if ids.shape[-1] == 1:
        return True
    ordered = ids.sort(dim=-1).values
    return bool((ordered[..., 1:] > ordered[..., :-1]).all())
