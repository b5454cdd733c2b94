"""The embedded default model: a tiny random-init Qwen2 + a byte-level tokenizer, made in code.

`python train_grpo.py` with no flags needs a model without any download, so
`write_embedded_model(out_dir)` writes a complete HF model directory:

  config.json             Qwen2ForCausalLM, hidden 64, 2 layers, 4 heads / 2 kv heads,
                          tied embeddings, vocab_size 259 (= the tokenizer, see below)
  model.safetensors       random init from transformers (std 0.02), seeded
  tokenizer.json (+ tokenizer_config.json, chat_template.jinja)
                          byte-level BPE with NO merges: token id b is byte b (0..255),
                          then <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258
  generation_config.json  eos = <|im_end|> (and <|endoftext|>), pad = <|endoftext|>

Why the tokenizer looks like this. transformers 5 does not load the tokenizer of a
`model_type: qwen2` directory as the class we save: AutoTokenizer rebuilds it as
Qwen2Tokenizer (NFC normalizer, Qwen2's split regex, ByteLevel with the GPT-2
byte->unicode alphabet) and only keeps our vocab, merges and added tokens. So the vocab
must be spelled in that byte->unicode alphabet, or every prompt silently becomes other
tokens. With no merges the split regex cannot change any id (every byte is its own
token), and we use the same NFC normalizer, so the tokenizer.json on disk (read by
`tokenizers` directly, or by vLLM) and AutoTokenizer give identical ids.
Consequence of NFC (as for the real Qwen2): decode(encode(text)) == NFC(text), which is
`text` itself for all ASCII and for any already-normalized text.

Why vocab_size = 259 exactly and not a rounder number: any id the model can emit should
decode to something. Megatron pads the vocabulary to a multiple of 128*tp inside the
model (common/model/bridge.py); those padding rows are zero, so their logits are 0, about the
size of every real logit at random init: samplers and logprobs must use only the first
`vocab_size` logits.
"""

import json
import os
import shutil
import tempfile

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
TOKENIZER_SIZE = 256 + len(SPECIAL_TOKENS)

# ChatML, as Qwen's instruct models, without a default system message (prompts stay short:
# every byte is a token).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The default architecture. Small enough that a GRPO step takes a fraction of a second on
# 2 CPU cores; override any field with write_embedded_model(..., hidden_size=128, ...).
DEFAULT_CONFIG = dict(
    vocab_size=TOKENIZER_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=ENDOFTEXT_ID,
    eos_token_id=IM_END_ID,
    pad_token_id=ENDOFTEXT_ID,
)

# The embedded models (the scripts' --embedded-model): overrides of DEFAULT_CONFIG. "moe" is
# the same tiny body with a Qwen3-MoE MLP in every layer, 8 experts of which each token uses
# 2 (renormalised top-2). "deepseek" is a DeepSeek-V3: multi-latent attention (q LoRA), layer
# 0 dense, layer 1 with 8 sigmoid-routed experts in 4 groups (top-4 experts of the top-2
# groups, a score-correction bias) and a shared expert. "qwen3_5" is a Qwen3.5: a gated delta net
# layer, then a gated full-attention layer; "qwen3_5_moe" the same with an MoE MLP in each. "gpt_oss" is a
# gpt-oss (common/model/bridge_gptoss.py).
EMBEDDED_MODELS = {
    "dense": {},
    "moe": dict(
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        head_dim=16,
    ),
    # DeepSeek-V3's own attention head sizes (latent 512, q/k 128 + rope 64, v 128): the only
    # ones vLLM's MLA kernels take on H100/H200, so the same flag runs on a GPU
    "deepseek": dict(
        architecture="DeepseekV3ForCausalLM",
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        tie_word_embeddings=False,
    ),
    # Qwen3.5: a gated delta net (2 key heads shared by 4 value heads) then gated full attention
    # with partial RoPE, zero-centred norms
    "qwen3_5": dict(
        architecture="Qwen3_5ForCausalLM",
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    # gpt-oss: attention sinks, a sliding window of 16 keys then full attention, YaRN as released
    # (untruncated), 8 biased experts (top-2) with the clamped SwiGLU, q/k/v/o biases
    "gpt_oss": dict(
        architecture="GptOssForCausalLM",
        head_dim=16,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ),
}
# Qwen3.5-MoE: the same two layers, each with 8 experts (top-2, renormalised) and a gated shared expert
# (its config has no intermediate_size: None leaves a field out)
EMBEDDED_MODELS["qwen3_5_moe"] = dict(
    EMBEDDED_MODELS["qwen3_5"],
    architecture="Qwen3_5MoeForCausalLM",
    intermediate_size=None,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)
# (Qwen3_5Config, Qwen3_5MoeConfig are the vision-language ones)
CONFIG_CLASSES = {"Qwen3_5ForCausalLM": "Qwen3_5TextConfig", "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig"}

MARKER = "embedded.json"  # what we wrote (seed + config): makes rewriting idempotent
FORMAT_VERSION = 1


def build_tokenizer():
    """The byte-level BPE tokenizer as a transformers PreTrainedTokenizerFast (not saved)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_symbol = bytes_to_unicode()  # GPT-2's printable alphabet for the 256 bytes
    vocab = {byte_to_symbol[b]: b for b in range(256)}  # id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()  # what Qwen2Tokenizer uses; see the module docstring
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # appended in order: 256, 257, 258
    assert tok.get_vocab_size() == TOKENIZER_SIZE and tok.token_to_id("<|im_end|>") == IM_END_ID

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",  # a chat turn ends the response
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,  # like Qwen2: nothing is prepended
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        extra_special_tokens=["<|im_start|>"],  # so it is in all_special_ids after reloading too
    )


def hf_config(config_kwargs):
    """The config.json fields of the embedded model made from these DEFAULT_CONFIG-style
    fields: `architecture` (default Qwen2ForCausalLM) becomes `architectures`."""
    fields = {k: v for k, v in config_kwargs.items() if v is not None}
    return dict(fields, architectures=[fields.pop("architecture", "Qwen2ForCausalLM")])


def build_model(config_kwargs, seed):
    """A random-init Qwen2ForCausalLM (or config_kwargs["architecture"]); the global torch RNG
    is left untouched."""
    import transformers

    fields = hf_config(config_kwargs)
    arch = fields["architectures"][0]
    config = getattr(transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config")))(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(config).float().eval()
        with torch.no_grad():  # transformers 5 starts MoE routers at zero (every expert tied): give them a direction
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, config.initializer_range)
    return model


def _fingerprint(seed, config_kwargs):
    return {"format": FORMAT_VERSION, "seed": seed, "config": config_kwargs}


def is_written(out_dir, seed=0, **config_overrides):
    """True when out_dir already holds the embedded model of this seed and config."""
    config_kwargs = {**DEFAULT_CONFIG, **config_overrides}
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    return written == json.loads(json.dumps(_fingerprint(seed, config_kwargs))) and all(
        os.path.isfile(os.path.join(out_dir, name)) for name in needed
    )


def write_embedded_model(out_dir, seed=0, **config_overrides):
    """Write the embedded tiny Qwen2 model + tokenizer to out_dir (an HF model dir); returns out_dir.

    config_overrides replace fields of DEFAULT_CONFIG (e.g. hidden_size=128, num_hidden_layers=4);
    a vocab_size below the tokenizer's 259 is refused. Idempotent: when out_dir already holds
    the same seed and config nothing is written. Safe when several ranks call it at once:
    each writes into its own temporary directory and moves the (identical) files in one by
    one with os.replace, the marker last.
    """
    config_kwargs = {**DEFAULT_CONFIG, **config_overrides}
    if config_kwargs["vocab_size"] < TOKENIZER_SIZE:
        raise ValueError(
            f"vocab_size={config_kwargs['vocab_size']} is smaller than the embedded tokenizer ({TOKENIZER_SIZE} tokens)"
        )
    if is_written(out_dir, seed, **config_overrides):
        return out_dir

    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    os.makedirs(out_dir, exist_ok=True)
    # The temporary dir is a sibling, on the same filesystem, so that os.replace is a rename.
    tmp_dir = tempfile.mkdtemp(prefix=".embedded-", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        model = build_model(config_kwargs, seed)
        progress_bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the training log
        try:
            model.save_pretrained(tmp_dir)  # safetensors; the tied lm_head is not stored
        finally:
            if progress_bar:
                hf_logging.enable_progress_bar()
        build_tokenizer().save_pretrained(tmp_dir)
        GenerationConfig(
            bos_token_id=ENDOFTEXT_ID,
            eos_token_id=[IM_END_ID, ENDOFTEXT_ID],  # stop at the end of the turn or of the text
            pad_token_id=ENDOFTEXT_ID,
        ).save_pretrained(tmp_dir)
        with open(os.path.join(tmp_dir, MARKER), "w") as f:
            json.dump(_fingerprint(seed, config_kwargs), f, indent=2)
        names = sorted(os.listdir(tmp_dir), key=lambda name: name == MARKER)  # marker last
        for name in names:
            os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
