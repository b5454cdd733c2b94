"""The embedded default model directory (common/run/embedded.py), reloaded the way users load it.

Run: .venv/bin/python -m pytest tests/test_embedded.py -q
"""

import json
import os
import random
import unicodedata

import pytest
import torch

from common.run.embedded import (
    CHAT_TEMPLATE,
    DEFAULT_CONFIG,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TOKENIZER_SIZE,
    write_embedded_model,
)


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory):
    return write_embedded_model(str(tmp_path_factory.mktemp("embedded") / "model"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def random_texts(n, seed=0):
    """Texts mixing ASCII, whitespace/control bytes, accents (NFD too), CJK and emoji."""
    rng = random.Random(seed)
    pools = [range(0x00, 0x80), range(0x80, 0x250), range(0x300, 0x370), range(0x4E00, 0x4E80), range(0x1F600, 0x1F650)]
    texts = []
    for _ in range(n):
        texts.append("".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(0, 40))))
    return texts + ["", " ", "  3+4=\n", "e\u0301", "\r\n\t", "<|im_end|>", "a<|im_start|>b", "é café 日本語 🤗"]


def test_tokenizer_is_bytes_plus_specials_after_reload(tokenizer, embedded_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(embedded_dir, "tokenizer.json"))  # what vLLM / tokenizers read
    assert len(tokenizer) == TOKENIZER_SIZE == 259
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (IM_END_ID, ENDOFTEXT_ID, None)
    assert set(tokenizer.all_special_ids) == {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}
    for text in random_texts(200):
        ids = tokenizer.encode(text, add_special_tokens=False)
        nfc = unicodedata.normalize("NFC", text)
        # The exact round trip (of the NFC form, as for Qwen2 itself).
        assert tokenizer.decode(ids) == nfc, repr(text)
        # Token id == byte value, specials aside: nothing was mapped to a wrong byte.
        plain = nfc.replace("<|im_end|>", "").replace("<|im_start|>", "")
        assert [i for i in ids if i < 256] == list(plain.encode("utf-8")), repr(text)
        # AutoTokenizer (rebuilt as Qwen2Tokenizer) and the raw tokenizer.json agree.
        assert raw.encode(text, add_special_tokens=False).ids == ids, repr(text)
    assert tokenizer.encode("7<|im_end|>", add_special_tokens=False) == [55, IM_END_ID]
    assert tokenizer.decode([55, IM_END_ID, ENDOFTEXT_ID], skip_special_tokens=True) == "7"


def test_chat_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n"


def test_model_config_and_weights(embedded_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from common.model.gpt import load_hf_spec

    spec = load_hf_spec(embedded_dir)  # the bridge accepts it
    assert spec.architecture == "Qwen2ForCausalLM" and spec.tie_word_embeddings
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (259, 64, 2, 4, 2)
    assert spec.vocab_size >= TOKENIZER_SIZE
    gen = GenerationConfig.from_pretrained(embedded_dir)
    assert gen.eos_token_id == [IM_END_ID, ENDOFTEXT_ID] and gen.pad_token_id == ENDOFTEXT_ID

    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[IM_START_ID, 51, 43, 52, 61]])).logits
    assert logits.shape == (1, 5, 259) and torch.isfinite(logits).all()
    # Random init is close to uniform: every token has some probability (GRPO needs exploration).
    probs = logits[0, -1].softmax(-1)
    assert probs.max() < 5.0 / 259 and probs.min() > 0.2 / 259


def test_idempotent_and_seeded(embedded_dir, tmp_path):
    from safetensors.torch import load_file

    weights = os.path.join(embedded_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    assert write_embedded_model(embedded_dir, seed=0) == embedded_dir
    assert os.stat(weights).st_mtime_ns == mtime  # not rewritten

    # The same seed in another directory gives bit-identical weights; another seed does not.
    same = load_file(os.path.join(write_embedded_model(str(tmp_path / "same"), seed=0), "model.safetensors"))
    reference = load_file(weights)
    assert all(torch.equal(same[k], reference[k]) for k in reference)
    other_dir = write_embedded_model(str(tmp_path / "same"), seed=1)  # rewrites in place
    other = load_file(os.path.join(other_dir, "model.safetensors"))
    assert not torch.equal(other["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    with open(os.path.join(other_dir, "embedded.json")) as f:
        assert json.load(f)["seed"] == 1

    # Overrides reach config.json; a vocab smaller than the tokenizer is refused.
    bigger = write_embedded_model(str(tmp_path / "bigger"), hidden_size=128, num_hidden_layers=4)
    with open(os.path.join(bigger, "config.json")) as f:
        config = json.load(f)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (128, 4)
    assert config["vocab_size"] == DEFAULT_CONFIG["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        write_embedded_model(str(tmp_path / "small"), vocab_size=200)
