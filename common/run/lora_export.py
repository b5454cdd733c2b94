"""merge_to_hf.py's side of a LoRA checkpoint (docs/lora.md): the base it names, and the PEFT export.

lora_settings(ckpt, base)        rl_meta.json's "lora" (rank, alpha, targets, base), or None for a whole model
load_lora_base(chunks, spec, lora)   the base's weights into the chunks, then adapters on them (B = 0)
write_peft_adapter(...)          adapter_config.json + adapter_model.safetensors in PEFT's names
write_peft_files(out_dir, factors, rank, alpha, base)   the same files of {HF weight name: (A, B)} (bench/lora_sync.py)
"""

import json
import os

import torch

from common.run.cli import ConversionError


def lora_settings(ckpt, base=None):
    """rl_meta.json's "lora" of a LoRA training checkpoint (rank, alpha, targets, base), the base replaced by
    `base` if given; None for a whole model. ConversionError if the base is not there."""
    from common.train.checkpoint import read_meta

    try:
        lora = read_meta(ckpt).get("lora")
    except FileNotFoundError:
        return None
    if not lora:
        return None
    lora = dict(lora, base=base or lora.get("base_mcore") or lora["base"])
    if not os.path.isdir(lora["base"]):
        raise ConversionError(
            f"--ckpt {ckpt} holds LoRA adapters of the base {lora['base']}, which is not a directory here: pass "
            "--lora-base DIR (that model's HF directory or converted megatron checkpoint)"
        )
    return lora


def load_lora_base(chunks, spec, lora):
    """The base model into the chunks (HF weights or a converted checkpoint), then its adapters (B = 0)."""
    from common.model.lora import add_lora
    from common.model.weights_load import load_hf_weights
    from common.train.checkpoint import is_model_checkpoint, load_model_checkpoint

    if is_model_checkpoint(lora["base"]):
        load_model_checkpoint(lora["base"], chunks)
    else:
        load_hf_weights(chunks, spec, lora["base"])
    add_lora(chunks, rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))


def write_peft_adapter(chunks, spec, lora, out_dir, dtype, rank):
    """PEFT's LoRA layout (write_peft_files) of a model's adapters. Megatron's fused linears are split as their
    weights are (common/model/bridge.py): q, k and v (gate and up) share the fused A and take their rows of B.
    TP = PP = 1 (the adapters are small): every factor here is whole."""
    from common.model.bridge import hf_from_shards, param_rule
    from common.model.lora import lora_modules

    if torch.distributed.get_world_size() != 1:
        raise ConversionError("--lora peft runs in one process (the adapters are small): drop torchrun and --tp/--pp")
    factors = {}
    for name, module in lora_modules(chunks).items():
        kind, hf_names = param_rule(f"{name}.weight", spec)
        for hf_name, b in hf_from_shards(kind, hf_names, [module.lora_b.detach()], spec):
            factors[hf_name] = (module.lora_a.detach().to(dtype), b.to(dtype))
    if rank == 0:
        write_peft_files(out_dir, factors, lora["rank"], lora["alpha"], lora["base"])


def write_peft_files(out_dir, factors, rank, alpha, base):
    """adapter_config.json and adapter_model.safetensors in out_dir: per HF linear of `factors` ({HF weight name:
    (A (r, in), B (out, r))}, any device) base_model.model.<module>.lora_A.weight and .lora_B.weight (CPU copies),
    the config naming `base`."""
    from safetensors.torch import save_file

    tensors, modules = {}, set()
    for hf_name, (a, b) in factors.items():
        prefix = "base_model.model." + hf_name.removesuffix(".weight")
        tensors[f"{prefix}.lora_A.weight"] = a.to("cpu", copy=True).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.to("cpu", copy=True).contiguous()
        modules.add(prefix.rsplit(".", 1)[1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    save_file(dict(sorted(tensors.items())), os.path.join(out_dir, "adapter_model.safetensors"), {"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
