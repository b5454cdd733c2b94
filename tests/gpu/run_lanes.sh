#!/usr/bin/env bash
# tests/gpu/run_all.sh on a 4-GPU machine in two device calls of < 10 minutes, the tests side by
# side in lanes of one or two GPUs (CUDA_VISIBLE_DEVICES); a 4-GPU machine costs the same device
# time per second as a 2-GPU one. After the stack prefix of run_all.sh's header:
#   bash tests/gpu/run_lanes.sh 2gpu    # the torchrun group but one test, in two lanes of two GPUs (~8 min)
#   bash tests/gpu/run_lanes.sh 1gpu    # the one-GPU tests and the SIGTERM case in two lanes, the exit cases
#                                       # and the torchrun group's DP=2 test on two GPUs (~7 min)
#   bash tests/gpu/run_lanes.sh features  # async + Qwen3.5, distillation, agentic + gpt-oss, LoRA + the agentic
#                                         # bench: a GPU each (~9 min)
#   bash tests/gpu/run_lanes.sh replay    # routing replay per model and layout: 1 GPU, 1 GPU, EP=2 (~8 min)
#   bash tests/gpu/run_lanes.sh pairs     # the 2-GPU cases of the features: agentic waves at TP=2 (GPUs 0,1),
#                                         # LoRA at TP=2 with its 1-GPU pair (2,3) (~8 min)
#   bash tests/gpu/run_lanes.sh split     # --rollout-gpus: the trainer and vLLM on GPUs of their own (0,1; ~7 min)
# Each lane's log goes to $OUT/lane_*.log when OUT
# is set (with the tests' JSON results); the exit code is the number of failed lanes.
set -u
cd "$(dirname "$0")/../.."
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 4 ] || { echo "run_lanes.sh needs 4 GPUs (found $NGPU): use tests/gpu/run_all.sh"; exit 2; }
LOGS=${OUT:-$(mktemp -d)}
lane() {  # lane NAME GPUS MODE ONLY
  CUDA_VISIBLE_DEVICES=$2 ONLY=$4 bash tests/gpu/run_all.sh "$3" > "$LOGS/lane_$1.log" 2>&1
}
case ${1:-} in
  2gpu)
    lane a 0,1 2gpu 'sdpa TP=2|train TP=2, rollout TP=2|moe EP=2|deepseek EP=2 allgather' & A=$!
    lane b 2,3 2gpu 'checkpoints|deepseek EP=2, rollout|TP=1 x2' & B=$! ;;
  1gpu)  # ~6.5-7 min per lane on H200s: the SIGTERM case after lane b's tests on GPU 1,
         # and the DP=2 agreement test after the exit cases on GPUs 2,3 (with it, the 2gpu
         # call's lane a ran out of its 560 s)
    lane a 0 1gpu 'offload|packing|recipes' & A=$!
    ( lane b 1 1gpu 'sdpa|logprobs|swiglu|agreement|moe|deepseek'; failed=$?
      lane signals 1 exit '^signals$'; exit $((failed + $?)) ) & B=$!
    ( lane exit 2,3 exit '^exit$'; failed=$?
      lane dp2 2,3 2gpu 'DP=2'; exit $((failed + $?)) ) & E=$! ;;
  features)  # on H200s (2026-11-28): async 282 s, Qwen3.5 256 s, distill 330 s, gpt-oss 92 s, LoRA 252 s,
             # agentic with one bench 472 s; the agentic benches (two) have their own entry, in the LoRA lane
    lane async 0 1gpu 'async|qwen35|gdn' & A=$!
    lane distill 1 1gpu 'distill' & B=$!
    lane agentic 2 1gpu 'agentic 1 GPU|gptoss' & E=$!
    lane lora 3 1gpu 'lora|agentic bench' & F=$! ;;
  replay)  # run_all.sh's two routing-replay entries, split by model over three lanes
    RR="python -m pytest -q -s -p no:cacheprovider tests/gpu/test_routing_replay_gpu.py -k"
    # each lane its own results folder: the test writes one routing_replay.json per process
    rr() { mkdir -p "$LOGS/$1"; OUT=$LOGS/$1 CUDA_VISIBLE_DEVICES=$2 $RR "$3" > "$LOGS/lane_$1.log" 2>&1; }
    rr rr_qwen3moe 0 qwen3moe-1 & A=$!
    rr rr_deepseek 1 deepseek-1 & B=$!
    rr rr_ep2 2,3 qwen3moe-2 & E=$! ;;
  pairs)
    P="python -m pytest -q -s -p no:cacheprovider"
    CUDA_VISIBLE_DEVICES=0,1 $P "tests/gpu/test_agentic_gpu.py::test_episodes_on_vllm_train_on_the_engines_ids[2]" \
      > "$LOGS/lane_agentic_tp2.log" 2>&1 & A=$!
    CUDA_VISIBLE_DEVICES=2,3 $P tests/gpu/test_lora_gpu.py > "$LOGS/lane_lora_tp2.log" 2>&1 & B=$! ;;
  split)
    lane split 0,1 2gpu 'rollout gpus' & A=$! ;;
  *) echo "usage: bash tests/gpu/run_lanes.sh 2gpu|1gpu|features|replay|pairs|split"; exit 2 ;;
esac
FAILED=0
for pid in ${A:-} ${B:-} ${E:-} ${F:-}; do wait "$pid" || FAILED=$((FAILED + 1)); done
for log in "$LOGS"/lane_*.log; do echo "##### $log"; sed -n '/=== summary/,$p' "$log"; tail -n 3 "$log"; done
echo "failed lanes: $FAILED"
exit $FAILED
