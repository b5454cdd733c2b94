"""The memory plan: what each rank holds, per phase of a step, on its GPU and in pinned host memory.

    plan = plan_memory(spec, world=4, tp=2, rollout_tp=2, gpu_bytes=80e9, micro_batch_tokens=16384, ...)
    plan.total("update"), plan.problems(), plan.host_parts()     # common/run/memory_check.py prints and refuses

(What a plan is, items x phases per pipeline stage, and its verdicts: common/run/memory_result.py.)

Pure arithmetic on the HF config (the bridge's HFModelSpec) and the flags: nothing is allocated,
no GPU is needed, so `--dry-run` plans an 8-GPU run on a laptop. GB are 10^9 bytes, as the
mem_*_gb metrics (common/train/offload.py PhaseMemory) and the host-memory check count them: an
"80GB" H100 holds 85.5 GB (79.6 GiB).

Phases and what they hold on the GPU (the scripts' order; the columns compare with the metrics):
  sync     the engine's weights woken and rewritten from the policy (still on the GPU), in
           buckets; then the policy goes to host memory and the KV cache wakes: mem_sync_gb
  rollout  the engine awake (its whole share: weights, KV cache, workspace) beside what the
           trainer keeps on the GPU (nothing with both offloads on): mem_rollout_gb
  logprob  the engine asleep; forward-only passes (old/reference logprobs, PPO's values) keep no
           activations, only one micro-batch's logits: mem_logprob_gb
  critic   PPO with the optimizers offloaded: the critic's update first, only its optimizer state on
           the GPU (the actor's in host memory, its gradients freed): mem_critic_gb
  update   weights, fp32 gradients, the optimizer and one micro-batch's saved activations (times
           the micro-batches a pipeline stage holds at once), the logits and their gradient:
           mem_train_gb
  save     the update's state without activations; host memory gets the staged copy
Megatron's mixed precision: bf16 weights (2 B), fp32 gradients (4 B: grad_reduce_in_fp32 in
common/train/setup.py), fp32 main weights + Adam's two moments (12 B) sharded over the data
(and context) parallel ranks by the distributed optimizer, routed experts over expert-data-parallel.

Where several pipeline stages differ (embedding, output layer, uneven layer counts, the micro-
batches a stage keeps in flight), every stage is planned and the fullest one is shown; the host
checks count the stage that pins the most.
"""

import math

from common.model.bridge import padded_vocab_size
from common.model.sizes import (
    FP32,
    ParamCount,
    count_lora_parameters,
    count_parameters,
    hf_parameter_count,
    in_flight_micro_batches,
    kv_cache_bytes_per_token,
    layer_working_bytes,
    stage_activation_bytes,
    stage_layer_indices,
)
from common.run.memory_result import GB, PROCESS_HOST, WARN_AT, Item, Plan, StagePlan

PHASES = ("sync", "rollout", "logprob", "update", "save")
TURN_PHASES = ("sync", "rollout", "logprob", "critic", "update", "save")  # PPO's two updates in turn
# the run's metrics (common/train/colocation.py PhaseMemory) that measure a phase
PHASE_METRICS = {
    "sync": "mem_sync_gb",
    "rollout": "mem_rollout_gb",
    "logprob": "mem_logprob_gb",
    "critic": "mem_critic_gb",
    "update": "mem_train_gb",
}
# Per process, outside the tensors counted here: the CUDA context with cuBLAS's workspaces (~0.6
# GB on an H100) and NCCL's buffers for megatron's process groups (~1-1.5 GB at 8 ranks). An
# estimate from those components, not a measurement.
PROCESS_OVERHEAD = 3.0 * GB
# With a colocated vLLM engine, what the process holds beyond the engine's share and the
# trainer's tensors, in every phase (asleep: its CUDA graphs, compile and sampler workspaces,
# communicators): the one colocated measurement, a 0.5B model on one H200 (docs/gpu.md: 59.2 /
# 55.8 / 12.8 / 20.0 GB in sync / rollout / logprob / update), is 11 GB above the tensors this
# plan counts in each phase, 8 GB more than PROCESS_OVERHEAD. The run's mem_*_gb metrics check it.
ENGINE_RESIDENT = 8.0 * GB
# torch's caching allocator rounds and fragments: its reserved memory runs a few percent above
# the tensors alive at a peak. Added to the torch-allocated items of every phase.
FRAGMENTATION = 0.05
# Inside the engine's share besides weights and KV cache: vLLM's activations for its profiled
# batch (max_num_batched_tokens) and the sampler's logits, and its CUDA graphs. An estimate.
ENGINE_WORKSPACE = 2.5 * GB
# At most this share of the GPU for the engine when it is derived; the derived share also keeps
# the rollout phase within WARN_AT of the GPU (a margin for the estimates above).
MAX_ENGINE_SHARE = 0.9


def plan_memory(
    spec,
    *,
    world,
    tp=1,
    pp=1,
    vpp=None,
    cp=1,
    ep=1,
    etp=1,
    sp=False,
    first_stage_layers=None,
    last_stage_layers=None,
    dtype_bytes=2,
    distributed_optimizer=True,
    reference=False,
    lora=None,
    critic=None,
    reward_model=None,
    teacher=None,
    engine="vllm",
    rollout_tp=1,
    engine_share=None,
    max_model_len=2048,
    update_tokens=2048,
    update_micro_batches=1,
    logprob_tokens=2048,
    recompute="none",
    recompute_modules=(),
    recompute_layers=1,
    offload_params=True,
    offload_optimizer=True,
    save_any_layout=False,
    sync_bucket_mb=512,
    remote_sync=None,
    gpu_bytes=None,
    gpus_per_node=1,
    node_bytes=None,
):
    """The plan of one run. spec / critic / reward_model: HFModelSpecs (critic: PPO's value model,
    reward_model: --reward-model's, teacher: --teacher's, None without). engine: "vllm" (colocated, asleep between
    rollouts), "hf" (the transformers engine: fp32 weights, always resident) or None
    (--load-rollouts). engine_share: vLLM's --gpu-memory-utilization, None to derive it from
    what the trainer keeps on the GPU during the rollout. update_tokens / logprob_tokens: tokens
    of one micro-batch per rank before CP splits them; update_micro_batches: how many a rank
    runs per optimizer step (bounds what a pipeline holds in flight). gpu_bytes: memory of one
    GPU, None for a CPU run (then every phase is host memory, compared with node_bytes /
    gpus_per_node). node_bytes: host memory of a node, None if unknown. lora: dict(rank=, targets=) of
    --lora-rank: gradients and the optimizer for the adapters alone, the reference is the policy itself.
    remote_sync (--rollout-gpus; engine None): "step" or "behind" (--sync-overlap): the sync's buckets in the sync
    phase, or beside every phase of the next step's passes."""
    on_gpu = gpu_bytes is not None
    device = "cuda" if on_gpu else "cpu"
    b = dtype_bytes
    optimizer_dp = world // (tp * pp) if distributed_optimizer else 1  # DP x CP shard the optimizer
    expert_dp = world // (pp * ep * etp) if distributed_optimizer else 1
    engine = engine if engine in ("vllm", "hf") else None
    if engine == "vllm" and not on_gpu:
        engine = "hf"
    layers = stage_layer_indices(spec.num_layers, pp, vpp, first_stage_layers, last_stage_layers)
    ranks = min(world, gpus_per_node)

    def counts(model, s, value_head=False, experts=True):
        return count_parameters(
            model,
            layers[s]
            if model is spec
            else stage_layer_indices(model.num_layers, pp, vpp, first_stage_layers, last_stage_layers)[s],
            tp=tp,
            ep=ep if experts else 1,
            etp=etp if experts else 1,
            first_stage=s == 0,
            last_stage=s == pp - 1,
            pp=pp,
            value_head=value_head,
        )

    def optimizer_bytes(n, per_param):  # sharded: dense over DP x CP, experts over expert-DP
        return n.dense * per_param / optimizer_dp + n.experts * per_param / expert_dp

    main_bytes = FP32 if b != FP32 else 0  # an fp32 model's main params are its own
    engine_weights = hf_parameter_count(spec) * (2 / rollout_tp if engine == "vllm" else FP32)
    layer_kw = dict(tp=tp, sp=sp, cp=cp, etp=etp, dtype_bytes=b, device=device)
    recompute_kw = dict(recompute=recompute, recompute_modules=recompute_modules, recompute_layers=recompute_layers)
    padded_vocab = padded_vocab_size(spec.vocab_size, tp) // tp
    # PPO with the optimizer state offloaded updates the critic, then the actor, each with only its own
    # optimizer state (and gradients) on the GPU (common/train/colocation.py turn): two phases
    turns = critic is not None and offload_optimizer and on_gpu
    phases = TURN_PHASES if turns else PHASES
    everywhere = " ".join(phases)
    critic_turn = " critic" if turns else ""

    stages = []
    for s in range(pp):
        policy = counts(spec, s)
        items = {}  # name -> Item, in the printed order

        def add(name, nbytes, phases, host=0.0, torch=True):
            """An item of nbytes on the device in `phases` (names, space separated) and `host` pinned."""
            items[name] = Item(name, {p: nbytes for p in phases.split() if nbytes}, host=host * on_gpu, torch=torch)

        def when(keep, phases):  # an offloadable tensor: also in the rollout if kept on the device
            return phases + (" rollout" if keep else "")

        # -- each model's state. Offloaded (common/train/offload.py) it waits in pinned host memory:
        # the policy's weights once synced into the engine, until the rollout ends; the optimizer
        # (fp32 main weights, Adam) from the rollout to the update; gradients are freed, not moved
        trained = policy  # LoRA: the adapters (dense, sharded as common/model/lora.py says), the base frozen
        if lora:
            trained = ParamCount(
                dense=count_lora_parameters(spec, layers[s], rank=lora["rank"], targets=lora["targets"], tp=tp)
            )
        weights, grads = (policy.total + trained.total * bool(lora)) * b, trained.total * FP32
        main, adam = optimizer_bytes(trained, main_bytes), optimizer_bytes(trained, 2 * FP32)
        keep_params, keep_opt = not offload_params, not offload_optimizer
        keep_grads = keep_params and keep_opt  # either offload frees the gradient buffers
        add(
            f"policy weights ({dtype_name(b)})",
            weights,
            when(keep_params, "sync logprob update save" + critic_turn),
            host=weights * offload_params,
        )
        # (the optimizer's offload frees them before the sync, the policy's after it)
        add("gradients (fp32)", grads, when(keep_grads, ("sync logprob " if keep_opt else "") + "update save"))
        optimizer_phases = everywhere if keep_opt else "update save"
        add(f"fp32 main weights (/{optimizer_dp} ranks)", main, optimizer_phases, host=main * offload_optimizer)
        add(f"Adam moments (2 x fp32, /{optimizer_dp} ranks)", adam, optimizer_phases, host=adam * offload_optimizer)
        # frozen models: offloaded, each is on the device for its own pass only, and those passes
        # run one at a time (the reward model's scoring, the reference's logprobs): the largest counts
        frozen = {}
        if reference and not lora:  # (LoRA's reference: the policy with its adapters off)
            frozen[f"reference weights ({dtype_name(b)})"] = weights
        if reward_model is not None:
            frozen[f"reward model weights ({dtype_name(b)})"] = counts(reward_model, s, True, False).total * b
        if teacher is not None:  # on-policy distillation's teacher: its own size, the policy's layout
            frozen[f"teacher weights ({dtype_name(b)})"] = counts(teacher, s).total * b
        one_pass = max(frozen, key=frozen.get, default=None)
        for name, nbytes in frozen.items():
            frozen_phases = everywhere if keep_params else "logprob" if name == one_pass else ""
            add(name, nbytes, frozen_phases, host=nbytes * offload_params)
        if critic is not None:  # PPO's critic: idle from the rollout until its values pass, then trained
            c = counts(critic, s, value_head=True)
            cw, cg, co = c.total * b, c.total * FP32, optimizer_bytes(c, main_bytes + 2 * FP32)
            add(
                f"critic weights ({dtype_name(b)})",
                cw,
                everywhere if keep_params else "logprob update save" + critic_turn,
                host=cw * offload_params,
            )
            grad_phases = everywhere if keep_grads else "logprob update save" if keep_opt else "update save"
            # in turns: on the GPU for the critic's update only (a save brings them back after the actor's
            # part, with the actor's freed: less than the critic phase, which also holds activations)
            add("critic gradients (fp32)", cg, "critic" if turns else grad_phases)
            add(
                "critic optimizer (main + Adam)",
                co,
                "critic" if turns else optimizer_phases,
                host=co * offload_optimizer,
            )

        # -- the rollout engine: vLLM's share of the GPU while awake (weights, KV cache,
        # workspace), asleep (level 2: nothing but the overhead) in the trainer's phases
        if engine == "hf":  # transformers in fp32, on the device in every phase, no sleep
            add("engine weights (fp32, transformers)", engine_weights, everywhere)
        elif engine == "vllm":
            add(f"engine weights (bf16, /{rollout_tp} rollout TP)", engine_weights, "sync rollout", torch=False)
            add("weight sync buckets", 2 * sync_bucket_mb * 2**20, "sync")
            items["engine KV cache"] = Item("engine KV cache", torch=False)  # sized below, from the share
            add("engine workspace (activations, CUDA graphs)", ENGINE_WORKSPACE, "rollout", torch=False)

        if remote_sync:  # engines on GPUs of their own: the flat buckets the first rank sends them
            sent = "sync" if remote_sync == "step" else " ".join(p for p in phases if p != "save")
            exported = hf_parameter_count(spec) * (2 if on_gpu else FP32)  # bf16 to vLLM, fp32 to the CPU engine
            add("weight sync buckets (to the engines' GPUs)", min(2 * sync_bucket_mb * 2**20, 2 * exported), sent)

        # -- activations and logits of one micro-batch (per rank: CP splits the tokens)
        saved, recomputed = stage_activation_bytes(spec, layers[s], **layer_kw, **recompute_kw)
        in_flight = in_flight_micro_batches(s, pp, vpp, update_micro_batches)
        tokens, lp_tokens = update_tokens / cp, logprob_tokens / cp
        name = f"activations ({update_tokens} tokens" + (f" x {in_flight:g} in flight)" if pp > 1 else ")")
        if critic is not None:  # the critic's update runs before the actor's, on the same micro-batches
            critic_layers = stage_layer_indices(critic.num_layers, pp, vpp, first_stage_layers, last_stage_layers)[s]
            critic_saved, critic_recomputed = stage_activation_bytes(critic, critic_layers, **layer_kw, **recompute_kw)
            if turns:
                add(f"critic {name}", tokens * (critic_saved * in_flight + critic_recomputed), "critic")
            elif critic_saved + critic_recomputed > saved + recomputed:
                saved, recomputed = critic_saved, critic_recomputed
        add(name, tokens * (saved * in_flight + recomputed), "update")
        # the forward-only passes run one at a time: the widest model's (the teacher's may be larger)
        working = max(layer_working_bytes(m, layer_kw) for m in (spec, teacher) if m is not None)
        add("forward-only pass (one layer's working set)", working * lp_tokens, "logprob")
        if s == pp - 1:  # only the last stage computes logits (T, V/tp); on a GPU the fused
            # log-softmax (common/rl/logprobs.py) keeps its fp32 math in registers: the logits and
            # their gradient in the model's dtype; eager (CPU) writes fp32 copies
            element = b + (0 if on_gpu else 2 * FP32)
            lp_vocab = max(padded_vocab, padded_vocab_size(teacher.vocab_size, tp) // tp if teacher else 0)
            logits = f"logits ({padded_vocab} vocabulary columns" + (
                f", the teacher's {lp_vocab})" if lp_vocab > padded_vocab else ")"
            )
            add(logits, lp_tokens * lp_vocab * element, "logprob")
            items[logits].device["update"] = tokens * padded_vocab * (b + element)

        # -- fixed: the allocator's slack over the tensors, the process's own
        if on_gpu:
            slack = {p: FRAGMENTATION * sum(i.device.get(p, 0) for i in items.values() if i.torch) for p in phases}
            items["allocator slack"] = Item("allocator slack", slack, torch=False)
            add("fixed overhead (CUDA context, NCCL)", PROCESS_OVERHEAD, everywhere, torch=False)
            if engine == "vllm":
                add("vLLM outside its share (measured)", ENGINE_RESIDENT, everywhere, torch=False)
        else:
            add("process (python, torch)", PROCESS_HOST, everywhere, torch=False)

        # -- host: checkpoint staging beyond the offload buffers, the optimizer's gather at a save
        if on_gpu:
            saved = trained.total * b if lora else weights  # a LoRA checkpoint holds the adapters alone
            checkpointed = saved + main + adam + (cw + co if critic is not None else 0)
            offloaded = (saved + (cw if critic is not None else 0)) * offload_params
            offloaded += (main + adam + (co if critic is not None else 0)) * offload_optimizer
            items["checkpoint staging (beyond the offload buffers)"] = Item(
                "checkpoint staging (beyond the offload buffers)", host=checkpointed - offloaded
            )
        if save_any_layout and distributed_optimizer and optimizer_dp > 1:  # 12 B/param of the TPxPP slice
            slice_params = trained.total + (c.total if critic is not None else 0)
            items["optimizer gather at a save (--save-any-layout)"] = Item(
                "optimizer gather at a save (--save-any-layout)", host_save=12 * slice_params
            )
        stages.append(StagePlan(s, list(items.values())))

    # -- the engine's share of the GPU: given, or what the trainer leaves during the rollout
    derived = engine == "vllm" and engine_share is None
    kv_tokens = 0
    if engine == "vllm":
        if derived:  # what the trainer keeps (and the fixed overhead) left out, up to WARN_AT of the GPU
            residual = max(st.total("rollout") - ENGINE_WORKSPACE - engine_weights for st in stages)
            hundredths = math.floor((WARN_AT * gpu_bytes - residual) / gpu_bytes * 100 + 1e-9)
            engine_share = max(0.0, min(MAX_ENGINE_SHARE, hundredths / 100))
        kv = engine_share * gpu_bytes - engine_weights - ENGINE_WORKSPACE
        kv_tokens = max(0, int(kv // kv_cache_bytes_per_token(spec, rollout_tp)))
        for st in stages:
            for item in st.items:
                if item.name == "engine KV cache":
                    item.device = {"rollout": max(kv, 0)}
    return Plan(
        stages=stages,
        phases=phases,
        device_bytes=gpu_bytes,
        node_bytes=node_bytes,
        ranks_per_node=ranks,
        engine_share=engine_share if engine == "vllm" else None,
        engine_share_derived=derived,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
    )


def dtype_name(nbytes):
    return {2: "bf16", 4: "fp32"}.get(nbytes, f"{nbytes} B")
