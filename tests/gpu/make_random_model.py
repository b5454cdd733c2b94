"""Write a random-weight Qwen2-shaped HF model dir for GPU runs (no downloads).

    python tests/gpu/make_random_model.py /tmp/qwen2-0.5b-shape [--shape 0.5b|1.5b|7b]
    python tests/gpu/make_random_model.py /tmp/qwen2-7b-full --shape 7b --vocab-size 152064 --untied

The transformer shapes are Qwen2's; the vocabulary is the embedded byte-level tokenizer's
(259 tokens, common/run/embedded.py) so that every sampled id decodes. --vocab-size gives the
model a real vocabulary's LM head and logprob cost (Qwen2-7B: 152064, untied; ids past the
tokenizer's 259 decode to nothing); throughput benchmarks (bench/e2e.py) want it. Weights are
fp32 (vLLM and the trainer cast to bf16).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="model vocabulary (default: the byte tokenizer's 259 tokens)"
    )
    ap.add_argument("--untied", action="store_true", help="an LM head apart from the embedding (as Qwen2-7B)")
    args = ap.parse_args()
    from common.run.embedded import TOKENIZER_SIZE, write_embedded_model

    write_embedded_model(
        args.out,
        seed=0,
        max_position_embeddings=4096,
        rope_theta=1e6,
        vocab_size=args.vocab_size or TOKENIZER_SIZE,
        tie_word_embeddings=not args.untied,
        **SHAPES[args.shape],
    )
    print("wrote", args.out)
