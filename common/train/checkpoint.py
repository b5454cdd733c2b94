"""Checkpoints: megatron-core dist_checkpointing (torch_dist), loadable at any TP/PP/VPP layout.

A model checkpoint directory holds
  - the dist_checkpointing files of {"model": <GPTModel sharded_state_dict>}; keys are
    megatron's global ones (decoder.layers.<global index>....), so a checkpoint written
    at one layout loads at another;
  - rl_meta.json: what wrote it, the architecture, dtype, versions;
  - hf/: the small HF files of the source model (config.json, generation_config.json,
    tokenizer files) so merge_to_hf.py can write a complete HF directory.

Training checkpoints (the full state to resume a run, with these as their model part) are
in common/train/save.py.
"""

import json
import os
import shutil

from common.model.chunks import unwrap
from common.model.lora import adapter_sharded_state_dict, lora_modules
from common.train.checkpoint_io import in_process_results

META_FILE = "rl_meta.json"
HF_DIR = "hf"
# small HF files carried with a checkpoint (never weights)
HF_SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def model_sharded_state_dict(chunks):
    """One sharded state dict for all of this rank's model chunks. The sharded tensors carry
    global keys (what is on disk); the dict keys are module names, which with virtual
    pipeline stages repeat across chunks (each numbers its layers from 0), so several chunks
    are nested under chunk{i}. With LoRA adapters (common/model/lora.py) only those: the base is frozen, it
    is loaded from where rl_meta.json's "lora" names."""
    lora = bool(lora_modules(chunks))

    def state(chunk):
        return adapter_sharded_state_dict(unwrap(chunk)) if lora else unwrap(chunk).sharded_state_dict()

    if len(chunks) == 1:
        return state(chunks[0])
    return {f"chunk{i}": state(chunk) for i, chunk in enumerate(chunks)}


def load_into_chunks(chunks, loaded):
    """Copy a loaded model state dict (nested as model_sharded_state_dict) into the chunks."""
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded if len(chunks) == 1 else loaded[f"chunk{i}"], strict=False)


def _leaf_keys(state):
    return (
        {f"{key}/{leaf}" for key, value in state.items() for leaf in _leaf_keys(value)}
        if isinstance(state, dict)
        else {""}
    )


def save_model_checkpoint(ckpt_dir, chunks):
    """Write the model weights of all ranks into ckpt_dir. All ranks call this."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    in_process_results()  # no helper process for the results (common/train/checkpoint_io.py)
    dist_checkpointing.save({"model": model_sharded_state_dict(chunks)}, ckpt_dir)


def load_model_checkpoint(ckpt_dir, chunks):
    """Load model weights written by save_model_checkpoint (or convert_hf_to_mcore.py) at
    whatever layout this run uses. All ranks call this."""
    from megatron.core import dist_checkpointing

    if not is_model_checkpoint(ckpt_dir):
        raise FileNotFoundError(
            f"{ckpt_dir} is not a megatron dist_checkpointing checkpoint (no metadata.json); "
            "pass a directory written by convert_hf_to_mcore.py or a training checkpoint step"
        )
    sharded = model_sharded_state_dict(chunks)
    state = dist_checkpointing.load({"model": sharded}, ckpt_dir)
    load_into_chunks(chunks, state["model"])
    missing = sorted(_leaf_keys(sharded) - _leaf_keys(state["model"]))
    if missing:
        raise RuntimeError(f"checkpoint {ckpt_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def is_model_checkpoint(ckpt_dir):
    return os.path.isfile(os.path.join(ckpt_dir, "metadata.json"))


def write_meta(ckpt_dir, meta: dict, hf_source_dir=None):
    """rl_meta.json plus the HF side files. Call on global rank 0 only."""
    from importlib.metadata import version  # not `import transformers`: 2 s just for a version string

    meta = dict(meta, versions={name: version(name) for name in ("torch", "megatron-core", "transformers")})
    with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    if hf_source_dir is not None:
        copy_hf_small_files(hf_source_dir, os.path.join(ckpt_dir, HF_DIR))


def read_meta(ckpt_dir):
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir} has no {META_FILE}: not a checkpoint written by this repository")
    with open(path) as f:
        return json.load(f)


def checkpoint_step(ckpt_dir):
    """How many training steps made a checkpoint's weights: rl_meta.json's step (a training
    checkpoint), else 0 (a converted HF model, or a checkpoint written elsewhere)."""
    try:
        return int(read_meta(ckpt_dir).get("step", 0))
    except FileNotFoundError:
        return 0


def copy_hf_small_files(src_dir, dst_dir):
    os.makedirs(dst_dir, exist_ok=True)
    for name in HF_SMALL_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
