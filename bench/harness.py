"""What the benchmark scripts share: model shapes, a model dir all ranks see, timing over ranks.

Shapes: config.json dicts of the published Qwen2 models, written from the configs of Qwen/Qwen2-0.5B, Qwen2-1.5B and Qwen2-7B on the HF hub (not
downloaded; only the shapes matter, the weights are random). NB: Qwen2-7B's vocabulary is
152064, not the 151936 of the two small ones. "tiny" is a 2-layer model of the same layout for
CPU smoke runs and the tests.
"""
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist


def qwen2_config(hidden, ffn, layers, heads, kv_heads, vocab, tied, max_pos=131072):
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "tie_word_embeddings": tied, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_pos, "use_sliding_window": False, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1,
    }


SHAPES = {
    "tiny": qwen2_config(hidden=64, ffn=192, layers=2, heads=4, kv_heads=2, vocab=512, tied=True, max_pos=4096),
    "qwen2-0.5b": qwen2_config(hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True),
    "qwen2-1.5b": qwen2_config(hidden=1536, ffn=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tied=True),
    "qwen2-7b": qwen2_config(hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False),
}


def write_config_dir(out_dir, shape):
    """A model dir with only config.json: enough for build_model (random init) and for vLLM
    with load_format="dummy" + skip_tokenizer_init (weights come from the first sync)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f, indent=1)
    return out_dir


def shared_config_dir(shape, prefix, master, with_weights=False):
    """A config.json-only model dir of `shape` made by the master rank, its path broadcast to
    every rank (all ranks call this; one host: a temporary directory). with_weights: also
    random HF weights (transformers' init), for an engine that loads them at start."""
    holder = [tempfile.mkdtemp(prefix=prefix) if master else None]
    dist.broadcast_object_list(holder)
    if master:
        write_config_dir(holder[0], shape)
        if with_weights:
            import transformers

            config = transformers.AutoConfig.from_pretrained(holder[0])
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(holder[0])
    dist.barrier()
    return holder[0]


def max_over_ranks(value, device):
    """The largest of every rank's value (all ranks call this; a world of one returns it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, device):
    """Seconds of fn(), the slowest rank's, with the device synchronised around it (all ranks
    call this)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return max_over_ranks(time.perf_counter() - t0, device)
