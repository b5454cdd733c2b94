"""GPU: VLLMEngine (common/rollout/vllm_engine.py) colocated with Megatron-Core agrees with both.

    python -m pytest -q -s tests/gpu/test_vllm_agreement.py                      # 1 GPU
    torchrun --nproc_per_node 2 tests/gpu/test_vllm_agreement.py --train-tp 2 --rollout-tp 2
    torchrun --nproc_per_node 2 tests/gpu/test_vllm_agreement.py --train-tp 2 --rollout-tp 1
(on the GPU machine after the stack prefix of shared/device/README.md; tests/gpu/run_all.sh
runs them all). Skipped without CUDA or vLLM.

A random-weight Qwen2-shaped model (~56M params, bf16, GQA, q/k/v bias) is written with
transformers, loaded into megatron (train TP) and synced into vLLM (rollout TP, started with
load_format="dummy", so every vLLM weight comes from the sync). Checked, in order:
  1. generate() before any sync is refused (the dummy weights are not the policy);
  2. sleep -> wake weights -> sync -> wake KV cache, timed;
  3. greedy: teacher-forced through transformers (fp32, the same bf16-rounded weights), each
     vLLM token is the argmax up to bf16 noise (gap <= GREEDY_GAP) and >= 90% exactly the
     argmax; sequences identical to transformers' own greedy decoding are counted;
  4. sampled tokens (T=1 and T=0.7): mean |vLLM logprob - megatron logprob| within
     LOGPROB_TOLERANCE or, if bf16 itself is noisier on this random model, within 2.5x the
     trainer's own bf16 error (megatron vs fp32 transformers, measured on the same tokens:
     0.02-0.04 on a CPU for this model); vLLM no further from fp32 than 2x megatron's error;
     a wrong temperature (0.76) or a wrong weight (~0.7) is far off;
  5. sleep / wake / re-sync of the same weights: greedy outputs identical;
  6. perturbed megatron weights, re-synced: greedy outputs change, and 3-4 hold again;
  7. the loop's weight-sync check of --rollout-logprobs prefill (common/rollout.generate_checked:
     the first sample of each replica scored by a prefill pass): as close to megatron as the
     sampled logprobs of 4, and far off when megatron's weights changed and the sync did not
     happen (the sampler's own logprobs of that stale engine are reported beside it).
Exact greedy equality of whole sequences is reported, not required: on this random model a
bf16 forward picks another argmax than fp32 at ~2-4% of positions (measured on a CPU with
transformers), so 16-token sequences diverge now and then without anything being wrong.
Timings (engine start, sleep, wake, sync) go to $OUT/vllm_agreement_*.json when OUT is set.
"""

import json
import math
import os
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch
import torch.distributed as dist

# bf16 noise of this model, measured on a CPU: transformers bf16 vs fp32, sampled-token mean
# |logprob diff| 0.021, max greedy gap 0.13 over 384 positions, argmax agreement 97.7%;
# megatron bf16 vs fp32 0.019-0.038 (T=1, 0.7). A wrong weight (layer 3's k and v swapped)
# moves sampled-token logprobs by 0.72 on average.
GREEDY_GAP = 0.25  # max (top-1 logprob - logprob of vLLM's greedy token) under fp32
GREEDY_ARGMAX = 0.9  # fraction of vLLM greedy tokens that are exactly fp32's argmax
LOGPROB_TOLERANCE = 0.02  # mean |vLLM - megatron| logprob of sampled tokens, bf16 both
VOCAB, EOS = 32000, 2
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=EOS,
)


def write_model(out_dir):
    """Random Qwen2 whose every layer matters but whose bf16 noise stays small: inner weights
    std 0.035 (larger ones grow the residual stream and the bf16 error with it), an lm_head
    of std 0.1 (entropy ~8 nats instead of ~10 at the default init), norms and biases
    perturbed away from 1 and 0."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**MODEL)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.1 if name == "lm_head.weight" else 0.035) * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def perturb(chunks):
    """Change every megatron weight. Noise seeded by the parameter's name: replicated tensors
    (norms; everything across DP) change identically on every rank, as they must; TP shards
    of one tensor get the same noise pattern, which is as good as any."""
    from common.model.chunks import named_global_parameters

    with torch.no_grad():
        for chunk in chunks:
            for name, p in named_global_parameters(chunk):
                g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
                p.add_(0.5 * p.float().std() * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))


def exported_state(chunks, spec):
    """Every HF tensor, as vLLM receives it (bf16), copied to fp32 CPU: the reference weights."""
    from common.model.weights import export_hf_weights

    return {name: t.float().cpu().clone() for name, t in export_hf_weights(chunks, spec, dtype=torch.bfloat16)}


def hf_reference(hf_dir, state):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.cuda().eval()


@torch.no_grad()
def greedy_checks(hf, samples):
    """Teacher-force vLLM's greedy tokens through transformers: the gap to the argmax at each
    step, exact-sequence matches with transformers' own greedy decoding, logprob error."""
    gaps, lp_err, exact, argmax = [], [], 0, 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        logprobs = torch.log_softmax(hf(ids).logits[0, len(s.prompt_ids) - 1 : -1].float(), -1)  # (R, V)
        chosen = logprobs.gather(-1, torch.tensor(s.response_ids, device="cuda")[:, None])[:, 0]
        gaps += (logprobs.max(-1).values - chosen).tolist()
        argmax += int((logprobs.argmax(-1).cpu() == torch.tensor(s.response_ids)).sum())
        lp_err += (chosen.cpu() - torch.tensor(s.response_logprobs)).abs().tolist()
        seq = list(s.prompt_ids)  # transformers' own greedy continuation
        for _ in range(len(s.response_ids)):
            seq.append(int(hf(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
        exact += seq[len(s.prompt_ids) :] == s.response_ids
    return dict(
        max_gap=max(gaps),
        argmax_fraction=argmax / len(gaps),
        exact_sequences=exact,
        rows=len(samples),
        greedy_logprob_err=sum(lp_err) / len(lp_err),
    )


def right_padded(samples):
    """(B, L) prompt+response token ids, right-padded with 0: the plain causal mask is exact."""
    length = -(-max(len(s.prompt_ids) + len(s.response_ids) for s in samples) // 8) * 8
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    for i, s in enumerate(samples):
        tokens[i, : len(s.prompt_ids) + len(s.response_ids)] = torch.tensor(s.prompt_ids + s.response_ids)
    return tokens.cuda()


def response_slices(logprobs, samples):
    """(B, L) per-position logprobs of the next token -> one (R,) tensor per sample."""
    return [
        logprobs[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) + len(s.response_ids) - 1].cpu()
        for i, s in enumerate(samples)
    ]


@torch.no_grad()
def hf_logprobs(hf, samples, temperature):
    """fp32 transformers: log_softmax(logits / T)[next token], the exact reference."""
    tokens = right_padded(samples)
    logprobs = torch.log_softmax(hf(tokens).logits.float() / temperature, -1)
    return response_slices(logprobs.gather(-1, torch.roll(tokens, -1, 1)[..., None])[..., 0], samples)


@torch.no_grad()
def megatron_logprobs(chunks, spec, samples, temperature):
    """log_softmax(logits / T)[token] of every response token, as the trainer computes it
    (vocab-parallel over the train TP group). All TP ranks pass the same samples."""
    from megatron.core import parallel_state as mpu

    from common.rl.logprobs import vocab_parallel_logprobs

    tokens = right_padded(samples)
    positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    logits = chunks[0](tokens, positions, None)  # (B, L, V_padded/tp)
    logprobs, _ = vocab_parallel_logprobs(
        logits.float(), torch.roll(tokens, -1, 1), spec.vocab_size, mpu.get_tensor_model_parallel_group(), temperature
    )
    return response_slices(logprobs, samples)


def gather_all(samples):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, samples)
    return [s for part in parts for s in part]


def logprob_checks(engine, chunks, spec, hf, prompts, temperature, seed, exact=True):
    """Over the sampled tokens of every replica: mean |vLLM - megatron| (the number the
    trainer cares about), each one's error against fp32 transformers (the bf16 noise floor;
    exact=False: not computed), and vLLM against megatron at a wrong temperature (a negative
    control, when T != 1)."""
    samples = gather_all(engine.generate(prompts, n=4, temperature=temperature, top_p=1.0, max_tokens=32, seed=seed))
    vllm_lp = torch.cat([torch.tensor(s.response_logprobs) for s in samples])
    ours = torch.cat(megatron_logprobs(chunks, spec, samples, temperature))
    row = {
        "tokens": len(vllm_lp),
        "mean_abs_diff": (vllm_lp - ours).abs().mean().item(),
        "max_abs_diff": (vllm_lp - ours).abs().max().item(),
    }
    if not exact:
        return row
    exact = torch.cat(hf_logprobs(hf, samples, temperature))
    row.update(vllm_vs_fp32=(vllm_lp - exact).abs().mean().item(), megatron_vs_fp32=(ours - exact).abs().mean().item())
    if temperature != 1.0:
        wrong = torch.cat(megatron_logprobs(chunks, spec, samples, 1.0))
        row["wrong_temperature_mean_abs_diff"] = (vllm_lp - wrong).abs().mean().item()
    return row


def prefill_check(engine, chunks, spec, samples):
    """The loop's logprob_mismatch under --rollout-logprobs prefill: mean |logprob from the
    engine's prefill of a sample (engine.score, T=1) - megatron's| over the samples given."""
    scored = torch.cat([torch.tensor(lp) for lp in engine.score(samples)])
    return (scored - torch.cat(megatron_logprobs(chunks, spec, samples, 1.0))).abs().mean().item()


def checked_samples(engine, prompts, seed):
    """Every replica's samples as the loop draws them under --rollout-logprobs prefill; the
    first of each replica carries its prefill score (what the loop's metric averages)."""
    from common.rollout.engine import generate_checked

    samples = gather_all(
        generate_checked(engine, prompts, "prefill", n=2, temperature=1.0, top_p=1.0, max_tokens=32, seed=seed)
    )
    return samples, [s for s in samples if not math.isnan(s.response_logprobs[0])]


def sync(engine, chunks, spec, timings, tag):
    """The training loop's step: sleep, (train), wake weights, sync, wake KV cache; timed."""
    from common.model.weights import export_hf_weights

    def timed(key, fn):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        timings[f"{tag}_{key}"] = round(time.perf_counter() - t, 4)

    timed("sleep_s", engine.sleep)
    timings[f"{tag}_free_GiB_asleep"] = round(torch.cuda.mem_get_info()[0] / 2**30, 2)
    timed("wake_weights_s", engine.wake_weights)
    timed(
        "sync_s",
        lambda: engine.update_weights(
            export_hf_weights(
                chunks,
                spec,
                dtype=torch.bfloat16,
                bucket_mb=64,
                expert_blocks=engine.expert_blocks,
                local_reads=engine.local_reads,
            )
        ),
    )
    timed("wake_kv_s", engine.wake_kv_cache)


def replay_against_loader(engine, chunks, spec):
    """The replayed sync (common/rollout/weight_replay.py) against vLLM's own loader, both from the
    same export: vLLM's parameters after a replayed sync are kept, overwritten with noise,
    then written by load_weights (+ the engine's direct expert copies, one expert tensor at a
    time, as before experts were stacked); every parameter must come out bit-equal. So the
    stacked expert copies (ExpertBlock, three per layer) are checked against per-expert ones,
    and at Megatron TP = vLLM TP the replay from each rank's own TP pieces (LocalShard,
    nothing gathered) against the loader's reads of the gathered tensors."""
    from common.model.weights import LocalShard, export_hf_weights

    plan = engine._write_plan
    assert plan is not None, "no sync recorded yet"
    pieces = []

    def counted(tensors):
        for name, t in tensors:
            if isinstance(t, LocalShard):
                pieces.append(name)
            yield name, t

    engine.update_weights(
        counted(
            export_hf_weights(
                chunks, spec, dtype=torch.bfloat16, bucket_mb=64, expert_blocks=True, local_reads=engine.local_reads
            )
        )
    )  # replayed, experts stacked
    params = dict(engine.model.named_parameters())
    replayed = {name: p.detach().clone() for name, p in params.items()}
    for p in params.values():
        p.data.normal_()  # what the loader does not write stays noise and shows below
    engine.model.load_weights(
        engine._copy_experts(export_hf_weights(chunks, spec, dtype=torch.bfloat16, bucket_mb=64), set())
    )
    differ = sorted(name for name, p in params.items() if not torch.equal(p, replayed[name]))
    return {
        "replayed_tensors": sum(1 for name in plan.steps if name not in plan.unreplayable),
        "not_replayed": sorted(plan.unreplayable),
        "broken": plan.broken,
        "params": len(params),
        "tp_pieces": len(pieces),
        "params_differ": differ[:5],
        "params_differ_count": len(differ),
    }


def run_agreement(train_tp=1, rollout_tp=1):
    """Everything above on this process's ranks; returns this rank's results (asserts inside)."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.rollout.vllm_engine import VLLMEngine
    from common.run.dist import init_distributed

    info = init_distributed(tp=train_tp)
    res = {"rank": info.rank, "world": info.world_size, "train_tp": train_tp, "rollout_tp": rollout_tp}
    hf_dir = [tempfile.mkdtemp(prefix="vllm_agree_") if info.rank == 0 else None]
    dist.broadcast_object_list(hf_dir)  # one node: a shared /tmp
    hf_dir = hf_dir[0]
    if info.rank == 0:
        res["params"] = write_model(hf_dir)
    dist.barrier()
    spec = load_hf_spec(hf_dir)
    chunks = build_model(spec, tp=train_tp, dtype=torch.bfloat16)
    load_hf_weights(chunks, spec, hf_dir)
    for c in chunks:
        c.eval()

    t = time.perf_counter()
    engine = VLLMEngine(
        hf_dir,
        rollout_tp=rollout_tp,
        gpu_memory_utilization=0.25,
        max_model_len=512,
        seed=0,
        enforce_eager=os.environ.get("TEST_VLLM_EAGER") == "1",
    )
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    # different prompts per replica, the same on the ranks of one replica
    g = torch.Generator().manual_seed(100 + engine.replica)
    prompts = [
        torch.randint(10, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (8,), generator=g)
    ]

    # 1. the dummy weights are refused
    with pytest.raises(AssertionError, match="update_weights first"):
        engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=4, seed=0)

    timings = res["timings"] = {}
    checked = None  # the initial phase's checked samples, scored again after the perturbation
    for phase in ("initial", "perturbed"):
        if phase == "perturbed":
            perturb(chunks)
            # 7. a sync that did not happen: the engine still holds the initial weights
            res["stale_prefill_mismatch"] = prefill_check(engine, chunks, spec, checked)
            res["stale_sampled_mismatch"] = logprob_checks(
                engine, chunks, spec, None, prompts, 1.0, seed=5, exact=False
            )["mean_abs_diff"]
        # 2. the loop's memory choreography
        sync(engine, chunks, spec, timings, phase)
        # 3. greedy against transformers with the same (bf16) weights
        state = exported_state(chunks, spec)
        res["sync_GB"] = round(sum(t.numel() for t in state.values()) * 2 / 2**30, 3)  # bf16
        hf = hf_reference(hf_dir, state)
        greedy = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=16, seed=0)
        res[f"{phase}_greedy"] = greedy_checks(hf, greedy)
        # 4. sampled-token logprobs against megatron (and both against fp32)
        res[f"{phase}_logprobs_T1"] = logprob_checks(engine, chunks, spec, hf, prompts, 1.0, seed=1)
        res[f"{phase}_logprobs_T0.7"] = logprob_checks(engine, chunks, spec, hf, prompts, 0.7, seed=2)
        # 7. the prefill check, as the loop logs it, and over every sample
        checked, first = checked_samples(engine, prompts, seed=4)
        loop = torch.cat([torch.tensor(s.response_logprobs) for s in first]) - torch.cat(
            megatron_logprobs(chunks, spec, first, 1.0)
        )
        res[f"{phase}_prefill"] = {
            "first_samples": len(first),
            "loop_mismatch": loop.abs().mean().item(),
            "all_samples_mismatch": prefill_check(engine, chunks, spec, checked),
        }
        del hf
        res[f"{phase}_tokens"] = [s.response_ids for s in greedy]
        if phase == "initial":
            # 5. a full sleep/wake/sync cycle of unchanged weights changes nothing
            sync(engine, chunks, spec, timings, "same_weights")
            again = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=16, seed=0)
            res["same_after_sleep_wake"] = [s.response_ids for s in again] == res["initial_tokens"]
    # 6. the perturbed weights really reached vLLM
    res["greedy_changed"] = sum(a != b for a, b in zip(res["initial_tokens"], res["perturbed_tokens"]))
    # 7. the replayed syncs write what vLLM's loader writes, bit for bit
    res["replay"] = replay_against_loader(engine, chunks, spec)
    t = time.perf_counter()
    out = engine.generate(prompts * 8, n=4, temperature=1.0, top_p=1.0, max_tokens=128, seed=3)
    res["gen_tok_per_s"] = round(sum(len(s.response_ids) for s in out) / (time.perf_counter() - t))

    if os.environ.get("OUT"):
        path = os.path.join(
            os.environ["OUT"], f"vllm_agreement_train{train_tp}_rollout{rollout_tp}_rank{info.rank}.json"
        )
        with open(path, "w") as f:
            json.dump({k: v for k, v in res.items() if not k.endswith("_tokens")}, f, indent=1)
    print("RESULT", json.dumps({k: v for k, v in res.items() if not k.endswith("_tokens")}), flush=True)
    check(res)
    return res


def check(res):
    for phase in ("initial", "perturbed"):
        greedy = res[f"{phase}_greedy"]
        assert greedy["max_gap"] <= GREEDY_GAP, (phase, greedy)
        assert greedy["argmax_fraction"] >= GREEDY_ARGMAX, (phase, greedy)
        assert greedy["greedy_logprob_err"] <= 2 * LOGPROB_TOLERANCE, (phase, greedy)
        for key in ("logprobs_T1", "logprobs_T0.7"):
            row = res[f"{phase}_{key}"]
            bound = max(LOGPROB_TOLERANCE, 2.5 * row["megatron_vs_fp32"])
            assert row["mean_abs_diff"] <= bound, (phase, key, row)
            assert row["vllm_vs_fp32"] <= 2 * row["megatron_vs_fp32"] + 0.005, (phase, key, row)
        row = res[f"{phase}_logprobs_T0.7"]
        assert row["wrong_temperature_mean_abs_diff"] > 5 * max(LOGPROB_TOLERANCE, row["mean_abs_diff"]), row
        # the prefill check holds as the sampled logprobs do (its numbers come from prefill kernels)
        bound = max(LOGPROB_TOLERANCE, 2.5 * res[f"{phase}_logprobs_T1"]["megatron_vs_fp32"])
        prefill = res[f"{phase}_prefill"]
        assert prefill["first_samples"] == res["world"] and prefill["all_samples_mismatch"] <= bound, (phase, prefill)
        assert prefill["loop_mismatch"] <= bound, (phase, prefill)
    # ... and shows a sync that did not happen
    assert res["stale_prefill_mismatch"] > 5 * max(LOGPROB_TOLERANCE, res["initial_prefill"]["all_samples_mismatch"]), (
        res
    )
    assert res["same_after_sleep_wake"]
    assert not res["replay"]["broken"] and res["replay"]["replayed_tensors"] > 0, res["replay"]
    assert res["replay"]["params_differ_count"] == 0, res["replay"]
    if res["train_tp"] == res["rollout_tp"] > 1:  # each rank wrote its own TP pieces, nothing gathered for them
        assert res["replay"]["tp_pieces"] > 0, res["replay"]
    assert res["greedy_changed"] >= len(res["initial_tokens"]) // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_vllm_agreement_single_gpu():
    pytest.importorskip("vllm")
    run_agreement(train_tp=1, rollout_tp=1)


def run_then_exit(fn, *args):
    """A torchrun entry point with an in-process vLLM engine: fn(*args), "PASS rank N" or the
    traceback, then os._exit (the engine can hang interpreter shutdown)."""
    try:
        fn(*args)
        print(f"PASS rank {dist.get_rank()}", flush=True)
        code = 0
    except Exception:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--train-tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    args = ap.parse_args()
    run_then_exit(run_agreement, args.train_tp, args.rollout_tp)
