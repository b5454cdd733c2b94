"""The PPO critic: build_model's GPTModel body with a scalar value head on the last stage.

    chunks = build_critic(spec, tp=..., pp=..., dtype=...)   # sharded like the policy
    load_critic_weights(chunks, spec, hf_dir)                # body from HF, head zero (or score.*)
    values = chunks[-1](tokens, positions, None)             # last stage: (B, T, 1), fp32

Kept apart from common/model/gpt.py and common/model/weights.py, which build and load the policy; this
file only swaps the output layer and loads the head.
"""

import dataclasses

import torch

from common.model.bridge import HFModelSpec
from common.model.gpt import build_model
from common.model.unsupported import UnsupportedModelError
from common.model.weights_load import HFCheckpointReader, load_hf_weights


class ValueHead(torch.nn.Module):
    """V(s_t) = w . h_t + b: a Linear(hidden, 1) that takes the place of GPTModel.output_layer.

    GPTModel._postprocess (megatron-core 0.16.1) calls
        output_layer(hidden_states, weight=None, runtime_gather_output=...) -> (out, bias)
    with hidden_states (S, B, H) after the final norm and returns out.transpose(0, 1), so the
    critic's forward returns values (B, S, 1) where the policy returns logits (B, S, V/tp):
    position t's value is the state that predicts target token t, aligned with the logprobs.

    Replicated on every TP rank (no tensor_model_parallel attribute: the grad norm counts it
    once). With sequence parallelism the hidden states arrive split along the sequence
    (S/tp, B, H); they are all-gathered first so every TP rank scores the full sequence and
    computes the same gradient for the replicated head. The gather's backward then only
    splits (tensor_parallel_output_grad=False): each rank's input gradient is complete for
    its own rows, no reduce-scatter (that would count the replicated head tp times).
    The head is applied in fp32 whatever the model dtype: values and returns are regression
    targets, and bf16's 8 mantissa bits are too coarse for them.
    """

    def __init__(self, hidden_size, sequence_parallel=False, dtype=torch.float32, device=None):
        super().__init__()
        # Named weight / bias as a Linear: megatron's LanguageModule.sharded_state_dict looks
        # up "output_layer.weight" on the last stage. On disk: output_layer.weight (1, H).
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel  # GPTModel reads this attribute in inference mode

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        values = torch.nn.functional.linear(hidden_states.float(), self.weight.float(), self.bias.float())
        return values, None  # (S, B, 1) fp32


def build_critic(spec: HFModelSpec, *, dtype=torch.float32, **layout):
    """The critic's chunks: build_model's GPTModel, sharded the same way as the policy, with
    the last pipeline stage's output layer replaced by a ValueHead. Its embeddings are untied
    whatever config.json says: the head must not share a matrix with the embedding (and
    with PP > 1 no embedding gradient is exchanged between the first and last stages).
    layout: build_model's keywords (tp, pp, vpp, ep, etp, sequence_parallel, attention, ...).
    Weights are uninitialised: load_critic_weights next."""
    chunks = build_model(dataclasses.replace(spec, tie_word_embeddings=False), dtype=dtype, **layout)
    for chunk in chunks:
        if chunk.post_process:  # only the last pipeline stage has an output layer
            device = next(chunk.parameters()).device
            chunk.output_layer = ValueHead(
                spec.hidden_size, sequence_parallel=chunk.config.sequence_parallel, dtype=dtype, device=device
            )
    return chunks


CRITIC_HEAD_NAMES = ("score.weight", "score.bias")  # looked for in the HF dir, shapes (1, H) and (1,)


def load_critic_weights(chunks, spec: HFModelSpec, hf_dir):
    """Body from the HF causal-LM dir (the policy's, or a given critic's), sharded as in
    load_hf_weights; its lm_head is not used. The value head is zero (V = 0 everywhere, so
    the first advantages are the plain rewards) unless the safetensors hold `score.weight`
    (1, hidden) and optionally `score.bias` (1,), as a reward model's score head, which
    are then copied in. Returns the number of tensors set."""
    count = load_hf_weights(chunks, spec, hf_dir, skip_prefixes=("output_layer.",))
    reader = HFCheckpointReader(hf_dir)  # no spec: score.* has no entry in the bridge's shape table
    expected = {"score.weight": (1, spec.hidden_size), "score.bias": (1,)}
    for chunk in chunks:
        if not chunk.post_process:
            continue
        head = chunk.output_layer
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
            for name, param in zip(CRITIC_HEAD_NAMES, (head.weight, head.bias)):
                if name in reader.names():
                    tensor = reader.read(name)
                    if tuple(tensor.shape) != expected[name]:
                        raise UnsupportedModelError(
                            f"{hf_dir}: {name} has shape {list(tensor.shape)}, "
                            f"a value head needs {list(expected[name])}"
                        )
                    param.copy_(tensor)
                    count += 1
    return count
