"""The rollout side's command-line flags, shared by train_grpo.py and train_ppo.py as
common/run/flags.py's groups are: the engine and sampling, the off-policy corrections of its
samples, and the reward. Each function returns its group."""

import argparse
import json

from common.rl.corrections import CORRECTIONS, resolve_correction
from common.rollout.engine import ROLLOUT_LOGPROBS


def rollout_flags(p, group_help, models):
    """The rollout engine, sampling, weight sync and what idles in host memory meanwhile."""
    g = p.add_argument_group("rollout")
    g.add_argument(
        "--rollout",
        choices=["auto", "vllm", "cpu"],
        default="auto",
        help="rollout engine; auto = vllm when a GPU and vllm are present, else the CPU engine",
    )
    g.add_argument(
        "--rollout-tp",
        type=int,
        default=1,
        help="vLLM tensor parallel size (independent of --tp); world/rollout-tp replicas get different prompts",
    )
    g.add_argument("--prompts-per-step", type=int, default=32, help="prompts per step, global")
    g.add_argument("--samples-per-prompt", type=int, default=8, help=group_help)
    g.add_argument("--max-new-tokens", type=int, default=1024, help="response length budget")
    g.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (logprobs are of logits / temperature)"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=(
            "vLLM's share of each GPU (weights + KV cache + its workspace); default: derived from the memory plan, "
            "what the trainer leaves on the GPU during the rollout (at most 0.9; --dry-run shows it); with "
            "--rollout-gpus, of the engine's own GPUs: default 0.85"
        ),
    )
    g.add_argument(
        "--rollout-eager",
        action="store_true",
        help=(
            "vLLM without torch.compile and CUDA graphs (its enforce_eager): the engine starts sooner (nothing "
            "compiled or captured) and decodes slower; for short runs, debugging and tests (the CPU engine: no effect)"
        ),
    )
    g.add_argument(
        "--true-on-policy",
        action="store_true",
        help=(
            "bitwise on-policy: vLLM batch-invariant and eager, the trainer's forward on vLLM's own kernels, so the "
            "trainer's logprobs equal the engine's exactly (logprob_mismatch 0.0, first ratio 1). Dense attention "
            "models, --cp 1, --rollout-tp equal to --tp, --temperature 1, --top-p 1, --rollout-logprobs all; slower "
            "(docs/algorithms.md)"
        ),
    )
    g.add_argument(
        "--rollout-logprobs",
        choices=list(ROLLOUT_LOGPROBS),
        default=None,
        help=(
            "which samples bring the rollout engine's logprobs, for logprob_mismatch (the weight-sync check) and "
            "--rollout-correction: prefill scores one sample per replica after sampling in a prefill pass (T=1 "
            "only; costs no decode time), one-per-prompt asks the sampler for one sample per prompt (~3%% of "
            "vLLM's time at 7B), all for every sample, none (no logprob_mismatch) (default: all with a "
            "--rollout-correction, else prefill at --temperature 1, else one-per-prompt)"
        ),
    )
    g.add_argument(
        "--sync-bucket-mb",
        type=int,
        default=512,
        help="weight sync bucket size (MB of full tensors; with --rollout-gpus, of each NCCL send to the engines)",
    )
    g.add_argument(
        "--offload-params",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"move Megatron's params ({models}) to host memory while they idle (default: on with vLLM on the "
        "trainer's GPUs, off with --rollout-gpus)",
    )
    g.add_argument(
        "--offload-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "move the optimizer state (Adam moments, fp32 main params) to host memory and free the grad buffers "
            "between updates (default: on with vLLM on the trainer's GPUs, off with --rollout-gpus)"
        ),
    )
    return g


def correction_flags(p):
    """Off-policy corrections of the engine's samples (common/rl/corrections.py) and the on-policy check."""
    g = p.add_argument_group("off-policy corrections (docs/algorithms.md#off-policy-corrections)")
    g.add_argument(
        "--rollout-correction",
        choices=CORRECTIONS,
        default=None,
        help=(
            "reweight or mask the loss's tokens by the trainer's old logprobs against the engine's (r = pi_old / "
            "pi_engine): tis min(r, high); seq-mask-is the sequence's product ratio, 0 outside [low, high]; icepop "
            "r, 0 outside [low, high]; geo-mask drops sequences whose geometric-mean r leaves [low, high]; decoupled "
            "(decoupled PPO) r, 0 above high; seq-offpolicy-mask (DeepSeek-V3.2) drops negative-advantage "
            "sequences whose mean log(pi_engine / pi) exceeds --correction-delta. Needs --rollout-logprobs all "
            "(the default then). Default: tis with --tis-cap, else none"
        ),
    )
    g.add_argument(
        "--correction-low",
        type=float,
        metavar="LOW",
        default=None,
        help="lower end of the accepted ratio band (seq-mask-is, geo-mask: default 1 / --correction-high; icepop: 0.5)",
    )
    g.add_argument(
        "--correction-high",
        type=float,
        metavar="HIGH",
        default=None,
        help="upper end of the band or the cap (tis 2, seq-mask-is 2, icepop 2, geo-mask 1.001, decoupled 5)",
    )
    g.add_argument(
        "--correction-delta",
        type=float,
        metavar="DELTA",
        default=None,
        help="seq-offpolicy-mask: the threshold on a sequence's mean log(pi_engine / pi) per token (default 0.5)",
    )
    g.add_argument(
        "--tis-cap",
        type=float,
        metavar="C",
        default=0.0,
        help="truncated importance sampling with rollout logprobs, weights capped here (0 = off): the same as "
        "--rollout-correction tis --correction-high C",
    )
    g.add_argument(
        "--check-on-policy",
        type=float,
        nargs="?",
        const=0.1,
        default=None,
        metavar="BOUND",
        help=(
            "stop the run (exit 5) after the step of its first update, saved and logged, when that update's mean "
            "abs(old - new) logprob (first_update_logprob_err, else ppo_kl) or logprob_mismatch exceeds BOUND "
            "(default 0.1: bf16 mismatches are ~0.02, a weight sync that did not happen ~3.4)"
        ),
    )
    return g


def resolve_true_on_policy(args):
    """--true-on-policy compares every sampled token: --rollout-logprobs all (given or not). ValueError: another.
    Where the mode can run at all is checked with the model (common/run/layout_checks.py)."""
    if not args.true_on_policy:
        return
    if args.rollout_logprobs not in (None, "all"):
        raise ValueError(
            f"--true-on-policy compares every sampled token: --rollout-logprobs all, not {args.rollout_logprobs}"
        )
    args.rollout_logprobs = "all"


def resolve_corrections(args):
    """--rollout-correction and its thresholds as the run uses them (common/rl/corrections.py
    resolve_correction), --check-on-policy checked. ValueError: what to change."""
    args.rollout_correction, args.correction_low, args.correction_high, args.correction_delta = resolve_correction(
        args.rollout_correction,
        tis_cap=args.tis_cap,
        low=args.correction_low,
        high=args.correction_high,
        delta=args.correction_delta,
    )
    if args.check_on_policy is not None and not args.check_on_policy >= 0:
        raise ValueError(f"--check-on-policy must be >= 0, not {args.check_on_policy}")
    if args.check_on_policy is not None and args.rollout_logprobs == "none":
        raise ValueError(
            "--check-on-policy compares the engine's logprobs with the trainer's: not with --rollout-logprobs none"
        )


def reward_flags(p):
    """The rule-based reward (built in, or the user's --reward), and a reward model next to (or instead of) it."""
    g = p.add_argument_group("reward")
    g.add_argument(
        "--reward",
        default=None,
        metavar="FILE.py:NAME",
        help=(
            "your own rule-based reward instead of the built-in one (math_reward with --data, else the embedded "
            "task's): NAME(response: str, answer: str) -> float, called once per sample with the decoded response "
            "and the prompt's reference answer; also decides validation (correct: >= 1). Checked at start-up "
            "(common/run/user_code.py)"
        ),
    )
    g.add_argument(
        "--reward-model",
        default=None,
        help=(
            "HF *ForSequenceClassification reward model dir or hub id (frozen, sharded like the policy, its own "
            "tokenizer and chat template): reward = --rule-reward-weight x rule + --reward-model-weight x score"
        ),
    )
    g.add_argument(
        "--reward-model-weight", type=float, default=1.0, help="weight of the reward model's score in the reward"
    )
    g.add_argument(
        "--rule-reward-weight",
        type=float,
        default=1.0,
        help="weight of the rule-based reward (0: the reward model alone)",
    )
    return g


def distill_flags(p):
    """On-policy distillation (common/rl/distill.py): a frozen teacher scores the student's samples."""
    g = p.add_argument_group("on-policy distillation")
    g.add_argument(
        "--teacher",
        default=None,
        metavar="DIR|ORG/NAME",
        help=(
            "on-policy distillation from this frozen HF causal LM (any supported architecture and size, the "
            "policy's tokenizer; sharded like the policy, offloaded but for its logprob pass): every response "
            "token's advantage gains --distill-coef x (teacher logprob - student logprob). Pure distillation, no "
            "task reward: --rule-reward-weight 0 (the rule reward is still logged as rule_reward_mean). "
            "docs/distillation.md"
        ),
    )
    g.add_argument(
        "--distill-coef",
        type=float,
        default=1.0,
        help="--teacher: weight of the per-token distillation advantage against the task advantage (> 0)",
    )
    g.add_argument(
        "--distill-topk",
        type=int,
        default=0,
        metavar="K",
        help=(
            "--teacher: distil the teacher's top-K tokens at every response position instead of the sampled "
            "token: the loss gains --distill-coef x the forward KL from the teacher renormalised over its top K "
            "to the student (metric distill_topk_kl); keeps N x T x K ids and logprobs from the teacher's pass "
            "(0: the sampled-token reverse-KL advantage)"
        ),
    )
    return g


# what the project passes to apply_chat_template itself: not for --chat-template-kwargs
TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "add_generation_prompt", "tokenize")


def chat_template_kwargs(text):
    """--chat-template-kwargs' value: a JSON object -> dict (argparse.ArgumentTypeError: what was wrong)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object, e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"a JSON object of the template's variables is needed, not a {type(value).__name__}: "
            "e.g. '{\"enable_thinking\": false}'"
        )
    taken = sorted(set(value) & set(TEMPLATE_ARGUMENTS))
    if taken:
        raise argparse.ArgumentTypeError(f"{', '.join(taken)}: set by the run itself (--env's tools), not here")
    return value


def chat_template_flags(p):
    """Variables of the chat template, wherever the run renders it (docs/running.md#chat-template-variables)."""
    g = p.add_argument_group("chat template")
    g.add_argument(
        "--chat-template-kwargs",
        type=chat_template_kwargs,
        default={},
        metavar="JSON",
        help=(
            "a JSON object of variables for the policy's chat template, wherever the run renders it (--data's "
            "prompts, validation's, --env's first prompts and observations), as vLLM's chat_template_kwargs: "
            "e.g. '{\"enable_thinking\": false}' for Qwen3 (its prompts then end in an empty <think></think>)"
        ),
    )
    return g


def env_flags(p):
    """Agentic episodes: an environment answers the model's turns (docs/agentic.md)."""
    g = p.add_argument_group("agentic episodes (docs/agentic.md)")
    g.add_argument(
        "--env",
        default=None,
        metavar="NAME|FILE.py:CLASS",
        help=(
            "multi-turn episodes: the environment answers each turn with an observation (tool output, feedback) "
            "or ends the episode with the reward, which replaces the rule-based one. Built in: game (guess a "
            "digit, told the digit after a miss; needs no --data), game-direction (told higher / lower), python "
            "(Python interpreter for math: the model calls a python tool in <tool_call> blocks, its code runs in "
            "the sandbox, the final answer is scored against --data's answers by the math reward); or your own "
            "common.env.base.Environment subclass CLASS in FILE.py. --max-new-tokens is then per turn"
        ),
    )
    g.add_argument("--max-turns", type=int, default=4, help="--env: model turns per episode at most")
    g.add_argument(
        "--max-episode-tokens",
        type=int,
        default=None,
        help=(
            "--env: the episode's context at most, first prompt + turns + observations (tokens); an episode that "
            "reaches it ends, marked truncated (default: the model's max_position_embeddings)"
        ),
    )
    g.add_argument(
        "--tool-timeout",
        type=float,
        default=10.0,
        help=(
            "--env: seconds a tool call may run (the sandbox kills the code then); an environment step still "
            "running 2 s after it is answered with an error observation and the episode goes on"
        ),
    )
    g.add_argument(
        "--tool-workers",
        type=int,
        default=32,
        help=(
            "--env: environment steps (tool calls) running at once, each in a thread; the others wait for a free "
            "one (--tool-timeout counts from a step's start)"
        ),
    )
    g.add_argument(
        "--tool-output-chars",
        type=int,
        default=4096,
        help="--env: a tool's output is cut to this many characters (the model is told how many were cut)",
    )
    return g


def check_env_flags(args):
    """--env's flags against the rest (ValueError: what to change)."""
    if not args.env:
        return
    if min(args.max_turns, args.tool_timeout, args.tool_output_chars, args.tool_workers) <= 0:
        raise ValueError(
            f"--max-turns {args.max_turns}, --tool-timeout {args.tool_timeout}, --tool-output-chars "
            f"{args.tool_output_chars}, --tool-workers {args.tool_workers}: each must be positive"
        )
    if args.max_episode_tokens is not None and args.max_episode_tokens < 2:
        raise ValueError(f"--max-episode-tokens {args.max_episode_tokens} leaves no room for a prompt and a turn")
    for flag, value in (
        ("--reward", args.reward),
        ("--overlong-buffer", getattr(args, "overlong_buffer", 0)),
        ("--bench-response-lengths", getattr(args, "bench_response_lengths", None)),
    ):
        if value:
            raise ValueError(f"{flag} applies to single-turn responses: the environment of --env gives the reward")
    if getattr(args, "routing_replay", "none") == "rollout":
        raise ValueError(
            "--routing-replay rollout replays the engine's routes of single-turn samples; with --env use "
            "--routing-replay old (or none)"
        )


def episode_settings(args):
    """run_episodes' keyword arguments (common/rollout/episodes.py) from the run's flags: sampling, the
    per-turn --max-new-tokens, --max-turns, --max-episode-tokens, the tools' time (a step may run
    --tool-timeout + 2 s: its sandbox's start and clean-up) and --tool-workers."""
    return dict(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
        max_episode_tokens=args.max_episode_tokens,
        step_timeout_s=args.tool_timeout + 2,
        max_workers=args.tool_workers,
    )
