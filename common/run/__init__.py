"""The run around the loop: command-line flags and their checks, inputs, outputs, processes.

    flags.py        the flag groups both training scripts share: model, parallel, batch; derived settings
    flags_run.py    their run's groups: data, steps and outputs, the memory plan; the default --out
    flags_rollout.py the shared groups of the rollout side: engine and sampling, corrections, reward
    flags_async.py  --off-policy-steps (partial rollouts with bounded staleness) and what it implies
    flags_algo.py   the algorithm's shared groups (the clipped policy loss, DAPO); what the groups imply together
    preflight.py    checks of a run's arguments and inputs before anything heavy is built (exit 2)
    layout_checks.py  their part on the parallel layout: world size, model shapes, micro-batches
    out_dir.py      --out's rules: the run lock, what counts as a run, --resume / --start-over
    model_checks.py the model directories a run is given: config, tokenizer, whole weights
    cli.py          what all four scripts share: the parser, output directories, error messages
    build.py        the training scripts' start-up: process groups, the engine, the models, resume, the logger
    step.py         what both loops do alike within a step: this rank's micro-batches, the teacher's pass, the save
    task.py         a run's task: tokenizer, prompts, held-out prompts, reward; the evaluator on them
    sampling.py     a step's samples and rewards (single-turn, episodes, partial rollouts, reward model)
    data.py         prompts: datasets, chat formatting, a resumable sampler
    hub.py          HF hub ids resolved through the HF cache
    embedded.py     the embedded tiny model and task of `python train_grpo.py`
    log.py          metrics.jsonl, wandb, the run record (config.json)
    console.py      the console: known-harmless warnings silenced, third-party log levels, the progress bar
    startup.py      where a run's start-up goes: seconds per stage, in one line
    plots.py        curves.png, each panel in one unit
    user_code.py    the user's --reward FILE.py:NAME, loaded and checked
    dist.py         torchrun / Slurm -> torch.distributed and megatron's parallel groups
    host_memory.py  pinned host memory of a node's ranks against what the node has
    memory_plan.py  GPU and pinned host memory per rank and phase, from the config and flags
    memory_result.py what a plan is (items x phases per pipeline stage) and its verdicts on the GPU and the node
    memory_check.py the plan at start-up: derived defaults, refusals
    memory_print.py the plan in words: the start-up summary, --dry-run's table
    convert_io.py   the disk side of convert_hf_to_mcore.py
    lora_export.py  the disk side of merge_to_hf.py for a LoRA checkpoint: its base, the PEFT adapter
    vl_export.py    merge_to_hf.py --vision-from: the vision-language checkpoint (Qwen3.5) written back whole

May import common.train, common.rollout, common.model and common.rl.
"""
