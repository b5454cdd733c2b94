#!/usr/bin/env bash
# Run every GPU test on the GPU machine, from the repo root, after the stack prefix of
# shared/device/README.md, e.g. (device tool, one command):
#   bash .gpu-stack/install_stack.sh .gpu-stack || exit 9; export PYTHONPATH=/tmp/site \
#     PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn; \
#     bash tests/gpu/run_all.sh [quick]
# One process per test (vLLM allows one engine per process);
# with >= 2 GPUs the torchrun variants follow. `quick` skips the slower 2-GPU layouts;
# `1gpu` runs the one-GPU tests but the exit test, `exit` only that one (~8 min: "exit", its three launch modes,
# then "signals", the SIGTERM case, 143 s alone on one H200), `2gpu` only
# the torchrun variants (to split a run across device calls of at most 10 minutes).
# ONLY=REGEX runs only the tests whose name below matches (bash =~), e.g. a 10-minute call
# each: ONLY='offload|sdpa|logprobs|packing|agreement' bash tests/gpu/run_all.sh 1gpu, then
# ONLY='moe|deepseek' ... 1gpu, then ONLY=recipes ... 1gpu, then bash tests/gpu/run_all.sh exit.
# On four GPUs, tests/gpu/run_lanes.sh runs these groups side by side in two calls.
# Results (JSON per test and rank) go to $OUT when set; the exit code is the number of failures.
# vLLM's Qwen3.5 module (the "qwen35" test) imports compressed-tensors, which pip installs with vllm; an
# offline stack without it takes the wheels, downloaded elsewhere and installed beside the stack:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl compressed-tensors==0.17.0 loguru
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# The fused gated-delta-net kernels ("gdn kernel"; "qwen35" trains on them where fla can) the same way:
# fla-core==0.6.0 and einops==0.8.2 (pure Python + Triton); without them "gdn kernel" is skipped.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
[ -n "${OUT:-}" ] && mkdir -p "$OUT"  # the tests write their JSON there
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
MODE=${1:-all}
FAILED=0
declare -a SUMMARY

run() {  # run NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  SUMMARY+=("$(printf '%-44s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
}

echo "GPUs: $NGPU"
if [ "$MODE" != 2gpu ] && [ "$MODE" != exit ]; then
run "offload (1 GPU, DP=2 if 2)" 300 python -m pytest -q -s -p no:cacheprovider tests/test_offload.py
run "host pool 1 GPU"        120 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_host_pool_gpu.py
run "sdpa 1 GPU"             300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_sdpa_gpu.py
run "fused logprobs 1 GPU"   300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_logprobs_gpu.py
run "swiglu 1 GPU"           300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_swiglu_gpu.py
# packed passes (varlen flash attention) vs padded ones, bf16 vs an fp32 reference
run "packing 1 GPU"          300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_packing_gpu.py
# vLLM through torchrun even on one GPU: its __main__ ends with os._exit (an in-process
# engine can hang interpreter shutdown, which pytest would wait for)
run "vllm agreement 1 GPU"   400 python -m torch.distributed.run --standalone --nproc_per_node 1 tests/gpu/test_vllm_agreement.py
# MoE: grouped experts vs the per-expert loop, vLLM vs megatron logprobs and top-k experts
run "moe 1 GPU"              400 python -m torch.distributed.run --standalone --nproc_per_node 1 tests/gpu/test_moe_gpu.py
# DeepSeek-V3: MLA (SDPA and packed varlen) vs fp32 transformers, vLLM vs megatron, top-k experts
run "deepseek 1 GPU"         400 python -m torch.distributed.run --standalone --nproc_per_node 1 tests/gpu/test_deepseek_gpu.py
# gpt-oss: sinks and sliding windows, biased experts; vLLM vs megatron, the replayed sync
run "gptoss 1 GPU"           400 python -m torch.distributed.run --standalone --nproc_per_node 1 tests/gpu/test_gptoss_gpu.py
# Qwen3.5 dense and MoE as released (vision-language checkpoints), the language model trained by GRPO on vLLM;
# the MoE with --routing-replay rollout (the trainer's top-k against vLLM's)
run "gdn kernel 1 GPU"       600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gdn_kernel_gpu.py
run "qwen35 1 GPU"           700 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_qwen35_gpu.py
# validation, DAPO sampling/shaping, a reward model, throughput metrics on the vLLM engine
run "recipes 1 GPU"          500 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_recipes_gpu.py
# on-policy distillation: a 1.5B-shaped student, a 7B-shaped teacher (4.9x), both scripts, phase times and memory
run "distill 1 GPU"          600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_distill_gpu.py
# --off-policy-steps: partial rollouts continued on vLLM across weight syncs, both scripts (docs/async.md)
run "async 1 GPU"            400 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_async_gpu.py
# MoE routing replay (R3) through train_grpo.py: vLLM's routes replayed, route and logprob mismatch
# --true-on-policy: vLLM's and megatron's modules and sampled logprobs equal bit for bit; GRPO with mismatch 0.0
# (at TP=2 among the torchrun variants below)
run "true on-policy 1 GPU"   900 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_true_on_policy_gpu.py -k "1"
run "routing replay 1 GPU"   600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_routing_replay_gpu.py -k "qwen3moe-1 or deepseek-1"
# agentic episodes (--env game) on vLLM request by request (and in waves at TP=2 with 2 GPUs); bench/agentic.py
# with tools of one length and of drawn lengths
run "agentic 1 GPU"          600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_agentic_gpu.py -k "not bench"
run "agentic bench"          500 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_agentic_gpu.py -k bench
# LoRA against full fine-tuning on the vLLM engine (merged-weight sync, memory, step time; TP=2 with 2 GPUs)
run "lora"                   600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_lora_gpu.py
# vLLM's LoRA adapters against the merged-weight sync (bench/lora_sync.py, docs/lora.md): two engine processes
# (a pair: ~5 min on an H200, the adapters' process the longer)
run "lora sync bench"        600 python bench/lora_sync.py --shape qwen2-1.5b --rank 16 --pairs 1 --reps 3
fi
if [ "$MODE" = all ] || [ "$MODE" = quick ] || [ "$MODE" = exit ]; then
# exit within 10 s of the last step with output piped (python, torchrun x1 and x NGPU); then
# SIGTERM during a run (its own entry: together they took 492 s of one 540-s limit on an H200)
run "exit"                   480 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_exit_gpu.py -k "not sigterm"
run "signals"                300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_exit_gpu.py -k sigterm
fi
if [ "$NGPU" -ge 2 ] && [ "$MODE" != 1gpu ] && [ "$MODE" != exit ]; then
  TR="python -m torch.distributed.run --standalone --nproc_per_node 2"
  run "sdpa TP=2"                        300 $TR tests/gpu/test_sdpa_gpu.py --tp 2
  # --rollout-gpus 1: the trainer on one GPU, vLLM on the other, weights over NCCL (415 s on two H200s)
  run "rollout gpus (2 GPUs)"            500 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_rollout_gpus_gpu.py
  # training checkpoints on NCCL: background saves staged through pinned host memory equal
  # synchronous ones, resume at TP=2/PP=2/DP=2 (the CPU suite's test, here on GPUs)
  run "training checkpoints (2 GPUs)"    400 python -m pytest -q -p no:cacheprovider tests/test_train_checkpoint.py
  run "vllm train TP=2, rollout TP=2"    400 $TR tests/gpu/test_vllm_agreement.py --train-tp 2 --rollout-tp 2
  # MoE / DeepSeek-V3 with megatron's experts over 2 GPUs (NCCL all-to-all, the sync gathering
  # experts over EP) against one vLLM engine over both GPUs (experts TP-sharded there)
  run "moe EP=2, rollout TP=2"           400 $TR tests/gpu/test_moe_gpu.py --ep 2 --rollout-tp 2
  run "deepseek EP=2, rollout TP=2"      400 $TR tests/gpu/test_deepseek_gpu.py --ep 2 --rollout-tp 2
  # --true-on-policy with the trainer at --tp 2 and vLLM at --rollout-tp 2 (365 s on two H200s)
  run "true on-policy TP=2"              500 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_true_on_policy_gpu.py -k "2"
  run "routing replay EP=2"              600 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_routing_replay_gpu.py -k "qwen3moe-2 or deepseek-2"
  # the other token dispatcher (common/model/moe.py DeviceSortDispatcher; the tests' batches have equal
  # sizes on both ranks, which it needs: bench/train.py --ab allgather measures it)
  run "moe EP=2 allgather, rollout TP=2" 400 $TR tests/gpu/test_moe_gpu.py --ep 2 --rollout-tp 2 --moe-dispatcher allgather
  run "deepseek EP=2 allgather, rollout TP=2" 400 $TR tests/gpu/test_deepseek_gpu.py --ep 2 --rollout-tp 2 --moe-dispatcher allgather
  if [ "$MODE" != quick ]; then
    run "vllm train TP=2, rollout TP=1 x2" 400 $TR tests/gpu/test_vllm_agreement.py --train-tp 2 --rollout-tp 1
    run "vllm train TP=1 (DP=2), rollout TP=2" 400 $TR tests/gpu/test_vllm_agreement.py --train-tp 1 --rollout-tp 2
  fi
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
echo "failed: $FAILED"
exit $FAILED
