"""The vision-language checkpoints whose language model is a text model of the bridge: Qwen3.5 and
Qwen3.5-MoE as released (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration).

Pure functions, like common/model/bridge.py (parse_hf_config calls text_config first):
  text_config(cfg)              a vision-language config.json -> (the text model's config, True), else
                                (cfg, False)
  checkpoint_aliases(names, spec)  the bridge's text names -> where a vision-language checkpoint
                                keeps each (HFCheckpointReader reads through these)
  vision_language_config(cfg)   a text Qwen3.5 config.json -> the vision-language one around it (the
                                form vLLM 0.26 registers Qwen3.5 in), else None

The layout (transformers 5.17 modeling_qwen3_5*.py, and its conversion_mapping.py "qwen3_5_text"):
  config.json    the text model's fields under "text_config"; tie_word_embeddings at the top
  tensors        the text model's `model.X` at `model.language_model.X`; `lm_head.weight` as is;
                 the vision tower `model.visual.*` and the multi-token-prediction head `mtp.*`
                 beside them, which training leaves out (a one-line notice says so)
  routed experts (MoE) per expert, `...mlp.experts.E.{gate,up,down}_proj.weight` (transformers'
                 save_pretrained), or fused per layer as released: `...mlp.experts.gate_up_proj`
                 (E, 2 I, H) holding each expert's [gate; up], `...mlp.experts.down_proj` (E, H, I)
What is trained is the text model: merge_to_hf.py writes it as the text CausalLM (config.json
the text config, tensors under `model.`), which transformers loads as a text model, or with
--vision-from the source as the vision-language checkpoint beside the source's vision tower
(common/run/vl_export.py; vLLM 0.26 serves Qwen3.5 only so); the MTP head is not written (docs/models.md).
"""

import re

# vision-language architecture -> the text CausalLM of its language model
VL_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
TEXT_TO_VL = {text: vl for vl, text in VL_ARCHITECTURES.items()}
VL_MODEL_TYPES = {"Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}
LANGUAGE_MODEL = "model.language_model."
NOT_TRAINED = ("model.visual.", "mtp.")  # the vision tower, the multi-token-prediction head
_FUSED = re.compile(r"(model\.language_model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def text_config(cfg: dict):
    """(the text model's config.json dict, whether cfg was a vision-language one)."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in VL_ARCHITECTURES:
        return cfg, False
    from common.model.unsupported import UnsupportedModelError

    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(
            f"config.json of a {archs[0]} has no 'text_config' object: the bridge takes the language model's "
            "fields from there (a config.json as transformers writes it)"
        )
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    dtypes = {k: cfg[k] for k in ("dtype", "torch_dtype") if k in cfg}  # the checkpoint's, at the top
    return dict(text, architectures=[VL_ARCHITECTURES[archs[0]]], tie_word_embeddings=tie, **dtypes), True


def vision_language_config(cfg: dict):
    """A text Qwen3.5 config.json (Qwen3_5(Moe)ForCausalLM, as merge_to_hf.py writes by default) -> the
    vision-language config.json around it: the text fields under text_config, the vision tower's fields
    transformers' defaults (its output width the text model's); None for any other model.
    text_config(vision_language_config(cfg)) gives cfg's fields back."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in TEXT_TO_VL:
        return None
    vl = TEXT_TO_VL[archs[0]]
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "dtype", "torch_dtype")}
    wrapped = dict(
        architectures=[vl],
        model_type=VL_MODEL_TYPES[vl],
        text_config=text,
        vision_config={"out_hidden_size": cfg["hidden_size"]},
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
    )
    return dict(wrapped, **{k: cfg[k] for k in ("dtype", "torch_dtype") if k in cfg})


def checkpoint_name(name):
    """The bridge's text-model name -> the vision-language checkpoint's (per-expert layout)."""
    return LANGUAGE_MODEL + name[len("model.") :] if name.startswith("model.") else name


def checkpoint_aliases(stored_names, spec):
    """{text name: (stored name, expert index or None, first row)} for a vision-language
    checkpoint whose tensors are `stored_names`: a fused expert tensor serves every expert's
    projections (gate: rows 0..I of its [gate; up], up: rows I..2I, down: all of (H, I))."""
    aliases = {}
    for stored in stored_names:
        if not stored.startswith(LANGUAGE_MODEL) and stored != "lm_head.weight":
            continue  # the vision tower, the MTP head: not trained
        fused = _FUSED.fullmatch(stored)
        if fused is None or spec.moe is None:
            text = "model." + stored[len(LANGUAGE_MODEL) :] if stored.startswith(LANGUAGE_MODEL) else stored
            aliases[text] = (stored, None, 0)
            continue
        prefix = "model." + fused[1][len(LANGUAGE_MODEL) :]
        inter = spec.moe.ffn_hidden_size
        for e in range(spec.moe.num_experts):
            if fused[2] == "down_proj":
                aliases[f"{prefix}.{e}.down_proj.weight"] = (stored, e, 0)
            else:
                aliases[f"{prefix}.{e}.gate_proj.weight"] = (stored, e, 0)
                aliases[f"{prefix}.{e}.up_proj.weight"] = (stored, e, inter)
    return aliases


def not_trained_notice(stored_names, vision_language=True):
    """The one line saying which tensors of a Qwen3.5 checkpoint training leaves out (the vision tower of a
    vision-language one, the multi-token-prediction head of either), or None."""
    left = sorted({p for name in stored_names for p in NOT_TRAINED if name.startswith(p)})
    if not left:
        return None
    what = {"model.visual.": "the vision tower (model.visual.*)", "mtp.": "the multi-token-prediction head (mtp.*)"}
    whose = "the vision-language checkpoint's language model is trained; " if vision_language else ""
    return (
        f"note: {whose}{' and '.join(what[p] for p in left)} {'are' if len(left) > 1 else 'is'} "
        "not loaded, not trained and not written back (merge_to_hf.py writes the text model)"
    )
