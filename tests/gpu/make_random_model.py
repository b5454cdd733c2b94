"""Write a random-weight Qwen2-shaped HF model dir for GPU runs (no downloads).

    python tests/gpu/make_random_model.py /tmp/qwen2-0.5b-shape [--shape 0.5b|1.5b|7b] [--full-vocab]

The transformer shapes are Qwen2's; the vocabulary is the embedded byte-level tokenizer's
(259 tokens, common/run/embedded.py) so that every sampled id decodes. --full-vocab gives the
embedding and output layer Qwen2's sizes (151936, 152064 at 7B; untied at 7B), as the memory and
speed of a real model need: the tokenizer stays the byte-level one, and ids beyond it decode to
nothing. Weights are fp32 (vLLM and the trainer cast to bf16).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Qwen2's vocabulary and embedding tying per size (--full-vocab)
FULL_VOCAB = {
    "0.5b": dict(vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, tie_word_embeddings=False),
}
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
}

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output HF model dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="Qwen2 size to mimic")
    ap.add_argument("--full-vocab", action="store_true", help="Qwen2's vocabulary size and tying (see above)")
    args = ap.parse_args()
    from common.run.embedded import write_embedded_model

    vocab = FULL_VOCAB[args.shape] if args.full_vocab else {}
    write_embedded_model(args.out, seed=0, max_position_embeddings=4096, rope_theta=1e6, **SHAPES[args.shape], **vocab)
    print("wrote", args.out)
