"""A model-based reward: an HF `*ForSequenceClassification` reward model as a frozen Megatron model.

    rm = RewardModel.load(rm_dir, tp=..., pp=..., cp=..., dtype=..., offload=...)   # sharded like the policy
    scores = rm.score(prompts, responses, device=...)   # (N,) fp32 on every rank; all ranks call it

The model is the critic's (common/model/critic.py): build_model's GPTModel body with a scalar head on
the last pipeline stage, here holding the checkpoint's `score.weight` (num_labels = 1). Its score
for a text is the head's output at the text's last token, as transformers' sequence classifiers
take it at the last non-padding token. Text: the reward model's own tokenizer and chat template
(a user turn with the prompt, an assistant turn with the response), so a reward model trained
with another template than the policy's scores what it was trained on; without a template,
prompt + response as plain text. tests/test_reward_model.py compares with transformers (fp32,
TP=1, TP=2 and CP=2).
"""

import json
import os

import torch

from common.model.bridge import ARCHITECTURES, parse_hf_config
from common.model.critic import build_critic, load_critic_weights
from common.model.unsupported import UnsupportedModelError
from common.rl import batch as B
from common.train import schedule

SUFFIX = "ForSequenceClassification"


def reward_model_spec(rm_dir):
    """The HFModelSpec of a reward model dir: a sequence classifier of a supported causal-LM
    architecture with one label (a scalar score)."""
    with open(os.path.join(rm_dir, "config.json")) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    causal = [a.replace(SUFFIX, "ForCausalLM") for a in archs if a.endswith(SUFFIX)]
    if len(archs) != 1 or not causal or causal[0] not in ARCHITECTURES:
        supported = sorted(a.replace("ForCausalLM", SUFFIX) for a in ARCHITECTURES)
        raise UnsupportedModelError(
            f"{rm_dir}: architectures {archs} is not a reward model the bridge supports (supported: {supported})"
        )
    if int(config.get("num_labels", len(config.get("id2label", {})) or 1)) != 1:
        raise UnsupportedModelError(
            f"{rm_dir}: num_labels must be 1 (one scalar score), not {config.get('num_labels')}"
        )
    return parse_hf_config(dict(config, architectures=causal))


class RewardModel:
    def __init__(self, chunks, tokenizer, micro_batch_size=8, offload=False):
        """offload: keep the weights in pinned host memory but while scoring (as the reference
        model: common/train/offload.py), for a GPU shared with the rollout engine."""
        from common.train.offload import Offloader

        self.chunks, self.tokenizer, self.micro_batch_size = chunks, tokenizer, micro_batch_size
        for chunk in chunks:
            chunk.eval().requires_grad_(False)
        self.offloader = Offloader.of_model(chunks) if offload else None
        if self.offloader is not None:
            self.offloader.offload()

    @classmethod
    def load(
        cls,
        rm_dir,
        *,
        tp=1,
        pp=1,
        vpp=None,
        cp=1,
        sequence_parallel=False,
        dtype=torch.float32,
        micro_batch_size=8,
        offload=False,
    ):
        """cp: the policy's context parallel size. It must be the run's: schedule.run_micro_batches cuts
        every pass over megatron's CP group, so the model's attention must gather over it too."""
        from transformers import AutoTokenizer

        spec = reward_model_spec(rm_dir)
        chunks = build_critic(spec, tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sequence_parallel, dtype=dtype)
        if load_critic_weights(chunks, spec, rm_dir) == 0 or not _has_score(rm_dir):
            raise UnsupportedModelError(f"{rm_dir}: no score.weight (the reward head) in its safetensors")
        return cls(chunks, AutoTokenizer.from_pretrained(rm_dir), micro_batch_size, offload)

    def token_ids(self, prompt, response):
        """The reward model's tokens for one (prompt, response); prompt: a string or chat messages."""
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": response}], tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        plain = "".join(m["content"] for m in messages)
        return self.tokenizer.encode(plain + response, add_special_tokens=True)

    @torch.no_grad()
    def score(self, prompts, responses, device):
        """(N,) fp32 scores of the N (prompt, response) pairs, on every rank. All ranks call this
        with the same pairs: each data-parallel rank runs its share (rows dp_rank::dp_size) through
        the pipeline, TP rank 0 of the last stage writes them, a sum over all ranks shares them.
        Under context parallelism each text is cut over the CP ranks like the policy's sequences
        (B.context_parallel_slice); its last token is on one of them, which writes the score,
        the others add 0."""
        from megatron.core import parallel_state as mpu

        ids = [self.token_ids(p, r) for p, r in zip(prompts, responses)]
        lengths = torch.tensor([len(t) for t in ids])
        multiple, _ = B.length_multiples(
            mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        )
        width = -(-int(lengths.max()) // multiple) * multiple
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        tokens = torch.full((len(ids), width), pad_id, dtype=torch.long)  # (N, T) right-padded
        for i, t in enumerate(ids):
            tokens[i, : len(t)] = torch.tensor(t)
        positions = torch.arange(width).expand(len(ids), width)
        batch = dict(
            tokens=tokens,
            positions=positions,
            row=torch.arange(len(ids)),
            last=lengths - 1,
            mask=(positions < lengths[:, None]).float(),
        )  # mask: how far each micro-batch is cut
        mine = torch.arange(len(ids))[mpu.get_data_parallel_rank() :: mpu.get_data_parallel_world_size()]
        scores = torch.zeros(len(ids), device=device)
        write = mpu.get_tensor_model_parallel_rank() == 0

        def loss_fn(mb, values):  # values (b, T_mb, 1) on the last stage (T_mb / cp of them under CP)
            if "src_col" in mb:  # CP: this rank's columns of each row; 0 where the last token is elsewhere
                values = torch.where(mb["src_col"] == mb["last"][:, None], values[..., 0], 0.0)
                picked = values.sum(1)
            else:
                picked = values[torch.arange(values.shape[0], device=values.device), mb["last"], 0]
            if write:
                scores[mb["row"]] = picked.float()
            return picked.sum() * 0, {}

        if self.offloader is not None:
            self.offloader.reload()
        if len(mine):
            mbs = B.micro_batches(
                batch,
                mine,
                self.micro_batch_size,
                length_multiple=multiple,
                same_length=mpu.get_pipeline_model_parallel_world_size() > 1,
            )
            schedule.run_micro_batches(self.chunks, mbs, loss_fn, forward_only=True, device=device)
        if self.offloader is not None:
            self.offloader.offload()
        return schedule.all_reduce_sum(scores, None, device).cpu()


def _has_score(rm_dir):
    from common.model.weights_load import HFCheckpointReader

    return "score.weight" in HFCheckpointReader(rm_dir).names()
