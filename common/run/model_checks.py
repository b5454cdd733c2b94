"""Checks of the model directories a training run is given (--model, --critic-model,
--reward-model, --mcore-ckpt), before anything is built: config.json the bridge can map, a
tokenizer, weights whose safetensors headers are whole and whose shapes agree with config.json
(the checks convert_hf_to_mcore.py makes). Each raises UsageError with one line.
"""

import json
import os

from common.model.bridge import parse_hf_config
from common.model.unsupported import UnsupportedModelError
from common.train.guard import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_reward_model(path, need_tokenizer=True):
    from common.train.reward_model import reward_model_spec

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--reward-model {path} has no config.json: pass a HuggingFace reward model directory")
    try:
        reward_model_spec(path)
    except (UnsupportedModelError, ValueError, KeyError) as e:
        raise UsageError(f"--reward-model {path}: {e}") from None
    if need_tokenizer and not set(os.listdir(path)) & set(TOKENIZER_FILES):
        raise UsageError(f"--reward-model {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def check_model_dir(path, flag, need_weights, need_tokenizer):
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: no such directory (pass a local HuggingFace model directory)")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise UsageError(f"{flag} {path} has no config.json: pass a HuggingFace model directory")
    try:
        with open(config) as f:
            spec = parse_hf_config(json.load(f))
    except json.JSONDecodeError as e:
        raise UsageError(f"{config} is not valid JSON ({e})") from None
    except KeyError as e:
        raise UsageError(f"{config} lacks the field {e}, which the bridge needs") from None
    except UnsupportedModelError as e:
        raise UsageError(f"{flag} {path}: {e}") from None
    if spec.gptoss is not None and spec.gptoss.mxfp4:  # the rollout engines would build MXFP4 experts
        raise UsageError(
            f"{flag} {path} holds MXFP4 expert weights (quantization_config mxfp4): the trainer dequantises them, "
            "but the rollout engine built from this config.json would keep MXFP4 experts that the bf16 weight sync "
            f"cannot fill. Write a bf16 copy first: python convert_hf_to_mcore.py --hf {path} --out CKPT && "
            "python merge_to_hf.py --ckpt CKPT --out DIR --dtype bf16, then pass DIR"
        )
    files = set(os.listdir(path))
    if need_tokenizer and not files & set(TOKENIZER_FILES):
        raise UsageError(
            f"{flag} {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
            "tokenizer files of the model into it"
        )
    if need_weights and not any(name.endswith(".safetensors") for name in files):
        bins = any(name.endswith(".bin") for name in files)
        raise UsageError(
            f"{flag} {path} has no *.safetensors weights"
            + (" (only .bin files: re-save it with save_pretrained(..., safe_serialization=True))" if bins else "")
            + "; or pass --mcore-ckpt"
        )
    if need_weights:
        check_weights(path, flag, spec, skip=() if need_tokenizer else ("lm_head.",))
    return spec


def check_weights(path, flag, spec, skip=()):
    """The safetensors headers of every shard against the files (missing, truncated, damaged)
    and config.json (every tensor it implies, with its shape), as convert_hf_to_mcore.py
    checks them: headers only, a few KB per shard. (NaN weights: found while loading,
    common/model/weights.py.) The critic's lm_head (skip) is not used."""
    from common.run.cli import ConversionError
    from common.run.convert_io import SafetensorsDir, check_hf_weights

    try:
        files = SafetensorsDir(path)
        files.as_text_model(spec)  # a vision-language checkpoint: its language model's tensors
        check_hf_weights(files, spec, path, skip=skip)
    except ConversionError as e:
        raise UsageError(f"{flag} {path}: {str(e).rstrip('.')}") from None


def check_mcore_ckpt(path, spec):
    """--mcore-ckpt: a model checkpoint of this architecture and size (by its hf/config.json)."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        hint = (
            f" (it holds training checkpoints: pass one step directory, e.g. {os.path.join(path, 'step_000100')})"
            if os.path.isfile(os.path.join(path, "latest"))
            else ""
        )
        raise UsageError(f"--mcore-ckpt {path} is not a megatron checkpoint (no metadata.json){hint}")
    config = os.path.join(path, "hf", "config.json")
    if not os.path.isfile(config):
        return  # written elsewhere: megatron's loader still checks every tensor's shape
    differ = model_differences(config, spec)
    if differ:
        raise UsageError(
            f"--mcore-ckpt {path} is of another model than --model: {'; '.join(differ)} (checkpoint vs model)"
        )


def model_differences(config_path, spec):
    """What differs between the model of config_path (an HF config.json) and spec: ["field A vs
    B", ...], empty when they are the same model shape."""
    try:
        with open(config_path) as f:
            saved = parse_hf_config(json.load(f))
    except (OSError, ValueError, KeyError, UnsupportedModelError) as e:
        return [f"unreadable {config_path} ({e})"]
    fields = (
        "architecture",
        "vocab_size",
        "hidden_size",
        "ffn_hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "qkv_bias",
        "qk_norm",
        "tie_word_embeddings",
        "moe",
        "mla",
    )
    show = lambda v: v if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__  # noqa: E731
    return [
        f"{name} {show(getattr(saved, name, None))} vs {show(getattr(spec, name, None))}"
        for name in fields
        if getattr(saved, name, None) != getattr(spec, name, None)
    ]


def check_teacher(path, policy_dir, policy_spec, dry_run=False):
    """--teacher: a causal LM the bridge maps, whose token ids mean the policy's (it scores the
    student's samples id by id). Its tokenizer must be the policy's (same tokens, same ids; policy_dir
    None: the embedded model's). Embedding rows may differ by padding (Qwen2.5-0.5B has 151936,
    Qwen2.5-7B 152064 rows for the same 151665 tokens): every row the tokenizer uses must exist in
    both. A dry run reads config.json alone: rows only. Returns the teacher's HFModelSpec."""
    spec = check_model_dir(path, "--teacher", need_weights=False, need_tokenizer=not dry_run)
    if dry_run:  # padding or not: the tokenizers (not read) decide
        return spec
    from transformers import AutoTokenizer

    if policy_dir is None:
        from common.run.embedded import build_tokenizer

        policy_tok = build_tokenizer()
    else:
        policy_tok = AutoTokenizer.from_pretrained(policy_dir)
    teacher_tok = AutoTokenizer.from_pretrained(path)
    policy_vocab, teacher_vocab = policy_tok.get_vocab(), teacher_tok.get_vocab()
    if policy_vocab != teacher_vocab:
        moved = sum(teacher_vocab.get(t) != i for t, i in policy_vocab.items())
        raise UsageError(
            f"--teacher {path}: its tokenizer has {len(teacher_vocab)} tokens, the policy's {len(policy_vocab)}"
            + (f" ({moved} of the policy's tokens missing or at other ids)" if moved else "")
            + ": the teacher scores the student's token ids, so it needs the policy's tokenizer (a model of the "
            "same family)"
        )
    used = max(policy_vocab.values()) + 1  # ids the tokenizer can produce
    for name, rows in (("the teacher", spec.vocab_size), ("the policy", policy_spec.vocab_size)):
        if rows < used:
            raise UsageError(
                f"--teacher {path}: {name} has {rows} embedding rows (vocab_size in config.json), fewer than the "
                f"{used} token ids of the shared tokenizer (teacher {spec.vocab_size} rows, policy "
                f"{policy_spec.vocab_size}): its config.json does not match its tokenizer"
            )
    return check_model_dir(path, "--teacher", need_weights=True, need_tokenizer=True)  # + its weights' headers
