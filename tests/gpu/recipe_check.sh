#!/usr/bin/env bash
# A recipe as a user runs it, checked end to end on GPUs: the memory plan (--dry-run), a first run
# that trains and saves, a resume that trains one more step; per run the node's host-memory peak,
# the wall time, the seconds from the last metrics line to the exit; then the measured GPU peaks of
# each phase (mem_*_gb) beside the plan's (config.json memory_plan_gb).
#   bash tests/gpu/recipe_check.sh NAME SHAPE SCRIPT STEPS [flags...]
#   e.g. bash tests/gpu/recipe_check.sh grpo-7b-tp2 7b train_grpo.py 2 --tp 2 --rollout-tp 2
# After the GPU stack's prefix (tests/gpu/run_all.sh's header). SHAPE: a Qwen2 size of
# tests/gpu/make_random_model.py, random weights with the full vocabulary, written once to
# $MODELS/SHAPE. All visible GPUs are used (CUDA_VISIBLE_DEVICES chooses). Results: $OUT/NAME.*
set -u
cd "$(dirname "$0")/../.."
NAME=${1:?usage: recipe_check.sh NAME SHAPE SCRIPT STEPS [flags...]}; SHAPE=$2; SCRIPT=$3; STEPS=$4; shift 4
MODEL=${MODELS:-/tmp/models}/$SHAPE
RESULTS=${OUT:-/tmp/recipe-results}; mkdir -p "$RESULTS"
RUN=/tmp/runs/$NAME; rm -rf "$RUN" "$RUN.dry"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
[ -f "$MODEL/config.json" ] || python tests/gpu/make_random_model.py "$MODEL" --shape "$SHAPE" --full-vocab >/dev/null || exit 1
TR=(python -m torch.distributed.run --standalone --nproc_per_node "$NGPU")

used_gb() { awk '/MemTotal/{t=$2} /MemAvailable/{a=$2} END{printf "%.1f", (t-a)/1e6}' /proc/meminfo; }
host_peak() {  # the node's peak of MemTotal - MemAvailable (GB), written to $1 until killed
  local peak=0 now
  while true; do now=$(used_gb); peak=$(awk -v a="$peak" -v b="$now" 'BEGIN{print (b>a)?b:a}'); echo "$peak" > "$1"; sleep 0.5; done
}
phase() {  # phase LABEL flags...: one launch of the script
  local label=$1; shift
  local base; base=$(used_gb)
  host_peak "$RESULTS/$NAME.$label.host" & local sampler=$!
  local t0; t0=$(date +%s.%N)
  "${TR[@]}" "$SCRIPT" --model "$MODEL" --out "$RUN" "$@" > "$RESULTS/$NAME.$label.log" 2>&1
  local rc=$? t1; t1=$(date +%s.%N)
  kill $sampler; wait $sampler 2>/dev/null
  local startup; startup=$(grep -m1 -o "start-up [0-9]* s[^\r]*" "$RESULTS/$NAME.$label.log" | tr -d '"')
  local last saved; last=$(stat -c %Y "$RUN/metrics.jsonl" 2>/dev/null || echo "$t1")
  saved=$(stat -c %Y "$RUN/checkpoints" 2>/dev/null || echo "$t1")  # the last save's rename into place
  printf '{"run": "%s", "phase": "%s", "rc": %s, "wall_s": %.0f, "host_before_gb": %s, "host_peak_gb": %s, "exit_after_last_step_s": %.1f, "exit_after_save_s": %.1f, "startup": "%s"}\n' \
    "$NAME" "$label" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" "$base" "$(cat "$RESULTS/$NAME.$label.host")" \
    "$(awk -v a="$last" -v b="$t1" 'BEGIN{print b-a}')" "$(awk -v a="$saved" -v b="$t1" 'BEGIN{print b-a}')" "$startup" \
    | tee -a "$RESULTS/$NAME.json"
  [ "$rc" = 0 ] || tail -30 "$RESULTS/$NAME.$label.log"
  return "$rc"
}
"${TR[@]}" "$SCRIPT" --model "$MODEL" --out "$RUN.dry" "$@" --dry-run > "$RESULTS/$NAME.plan.txt" 2>&1
grep -E "^(total|derived|train_|.*error)" "$RESULTS/$NAME.plan.txt" | head -8
phase first --steps "$STEPS" "$@" && [ "${RESUME:-1}" = 1 ] && phase resume --steps $((STEPS + 1)) --resume "$@"
python - "$RUN" <<'PY' | tee -a "$RESULTS/$NAME.json"
import json, sys
run = sys.argv[1]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
plan = json.load(open(f"{run}/config.json")).get("args", {}).get("memory_plan_gb", {})
measured = {k: max(r[k] for r in rows if k in r) for k in sorted({k for r in rows for k in r}) if k.startswith("mem_")}
keys = ("step_s", "rollout_s", "train_s", "sync_s", "offload_s", "reload_s", "save_blocking_s", "checkpoint_blocking_s")
print(json.dumps({"steps": len(rows), "gpu_measured_gb": measured, "gpu_planned_gb": plan,
                  "last_step": {k: round(rows[-1][k], 2) for k in rows[-1] if k in keys or "save" in k}}))
PY
