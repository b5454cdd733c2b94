"""Write a random-weight Qwen2-shaped (or Llama-shaped) HF model dir for GPU runs (no downloads).

    python tests/gpu/make_random_model.py /tmp/qwen2-0.5b-shape \
        [--shape 0.5b|1.5b|7b|14b|llama-1b|llama-8b] [--full-vocab]

The transformer shapes are Qwen2's; llama-1b is Llama-3.2-1B's (LlamaForCausalLM: no q/k/v bias, head
size 64, 8 kv heads, rope theta 5e5 with llama3 scaling, 131072 positions, tied embeddings); llama-8b is
Llama-3.1-8B's (head size 128, 8 kv heads, untied embeddings: the model of NeMo-RL's published async
figures). The vocabulary is the embedded byte-level tokenizer's (259 tokens, common/run/embedded.py) so that
every sampled id decodes. --full-vocab gives the embedding and output layer the family's sizes (Qwen2:
151936, 152064 at 7B, untied at 7B; Llama 3: 128256), as the memory and speed of a real model need: the
tokenizer stays the byte-level one, and ids beyond it decode to nothing. Weights are fp32 (vLLM and the
trainer cast to bf16).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# the family's vocabulary and embedding tying per size (--full-vocab)
FULL_VOCAB = {
    "0.5b": dict(vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(vocab_size=152064, tie_word_embeddings=False),
    "llama-1b": dict(vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=128256, tie_word_embeddings=False),
}
LLAMA3 = dict(  # Llama 3.1 / 3.2's config.json: positions and rope
    architecture="LlamaForCausalLM", rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0
)
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Qwen2 / Qwen2.5 configs)
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
    "14b": dict(  # Qwen2.5-14B
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8
    ),
    "llama-1b": dict(  # Llama-3.2-1B's config.json
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
        **LLAMA3,
    ),
    "llama-8b": dict(  # Llama-3.1-8B's config.json
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
        **LLAMA3,
    ),
}

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output HF model dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="model size (and family) to mimic")
    ap.add_argument("--full-vocab", action="store_true", help="the family's vocabulary size and tying (see above)")
    args = ap.parse_args()
    from common.run.embedded import write_embedded_model

    vocab = FULL_VOCAB[args.shape] if args.full_vocab else {}
    shape = dict(dict(max_position_embeddings=4096, rope_theta=1e6), **SHAPES[args.shape])  # Qwen2's defaults
    write_embedded_model(args.out, seed=0, **shape, **vocab)
    print("wrote", args.out)
