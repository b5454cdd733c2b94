"""GPU: gpt-oss (attention sinks, sliding windows, biased experts) on the GPU stack.

    torchrun --standalone --nproc_per_node 1 tests/gpu/test_gptoss_gpu.py     (tests/gpu/run_all.sh)
    torchrun --standalone --nproc_per_node 2 tests/gpu/test_gptoss_gpu.py --ep 2 [--rollout-tp 2]

A random gpt-oss-shaped model (bf16; gpt-oss's head size 64 and YaRN as released, hidden 512,
4 layers alternating a sliding window of 32 keys and full attention, 16 experts of 256, top-4)
written with transformers (tests/gpu/test_moe_gpu.py's write_model). Checked:
  1. megatron (common/model/gptoss.py's SinkAttention on torch SDPA with a mask, the experts as grouped GEMMs)
     in bf16 against fp32 transformers: mean |logprob difference| of sampled tokens <= 0.05;
  2. vLLM (dummy weights, every tensor from export_hf_weights: the fused expert tensors under the
     checkpoint's names, through vLLM's gpt-oss load_weights) vs megatron: mean |logprob
     difference| <= 0.02, prompts and samples long enough (up to 72 tokens) that the window acts;
  3. the replayed sync equal to vLLM's own loader, every parameter bit for bit.
--ep / --rollout-tp as in tests/gpu/test_moe_gpu.py. Results go to $OUT/gptoss_gpu[_ep2_rankN].json
when OUT is set.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB = 32000
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=4,
    sliding_window=32,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
)


def run(ep=1, rollout_tp=1, dispatcher=None):
    from tests.gpu.test_moe_gpu import result_path, setup, vllm_against_megatron
    from tests.gpu.test_vllm_agreement import replay_against_loader

    info, hf_dir, spec, chunks, res = setup(ep, "gptoss_gpu_", "GptOssForCausalLM", MODEL, dispatcher)
    for c in chunks:
        c.eval()
    engine, _ = vllm_against_megatron(hf_dir, chunks, spec, VOCAB, "gptoss", res, rollout_tp)
    res["replay"] = replay_against_loader(engine, chunks, spec)
    print("RESULT", json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        with open(result_path("gptoss_gpu", info, ep), "w") as f:
            json.dump(res, f, indent=1)
    assert res["megatron_vs_fp32"] <= 0.05, res
    assert res["mean_abs_diff"] <= max(0.02, 2.5 * res["megatron_vs_fp32"]), res
    assert not res["replay"]["broken"] and res["replay"]["params_differ_count"] == 0, res["replay"]


if __name__ == "__main__":
    from tests.gpu.test_moe_gpu import main

    main(run)
