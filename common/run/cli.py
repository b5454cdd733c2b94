"""What the command-line scripts share.

All four: `Parser`, an argparse parser whose errors are one line from rank 0 only (torchrun
starts N copies of a script: N usage blocks would bury the message), exit code 2; its help
lists each default once.
The offline tools (convert_hf_to_mcore.py, merge_to_hf.py): output directories that never
lose data (refuse a non-empty --out unless --force, write to <out>.incomplete, rename at the
end), the failures a user can fix turned into one-paragraph messages with an exit code, and
reading config.json with such messages.
"""

import argparse
import errno
import json
import math
import os
import shutil
import signal
import sys
import threading
import traceback

import torch

from common.model.unsupported import UnsupportedModelError
from common.run.dist import destroy_distributed, launcher_rank, print0

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help already speaks of its default or
    there is none to show (None, False): each default is said once."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one error line, printed by global rank 0 only; exit code 2 on every rank."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if launcher_rank() == 0:
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_with_defaults(parser, argv, defaults_if):
    """parser.parse_args(argv), where `defaults_if(known_args)` may return other defaults (a
    dict) that apply to the flags the user did not give; a flag given on the command line
    keeps its value even when it equals the usual default."""
    known, _ = parser.parse_known_args(argv)
    other = defaults_if(known)
    if other:
        parser.set_defaults(**other)
    return parser.parse_args(argv)


class ConversionError(Exception):
    """A problem with the input or the output directory the user can fix: printed, no traceback."""


def check_output_dir(out, force, inputs, looks_like_earlier_output):
    """Refuse an --out that would lose data. Touches nothing.

    A non-empty --out is refused unless --force, and even then only when it looks like an
    earlier output of the same script (never a directory of unrelated files) and contains
    none of the inputs."""
    out = os.path.abspath(out)
    for path in inputs:
        path = os.path.abspath(path)
        if path == out or path.startswith(out + os.sep):
            raise ConversionError(f"--out {out} is (or contains) the input {path}; choose another directory.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConversionError(f"--out {out} exists and is not a directory; nothing was written. Choose a directory.")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if entries and not force:
        raise ConversionError(
            f"--out {out} is not empty ({len(entries)} entries, e.g. {', '.join(entries[:3])}); nothing was "
            "written and nothing there was touched. Choose a new or empty directory, or pass --force to "
            "replace it (its old contents are removed only after the new output is complete)."
        )
    if entries and not looks_like_earlier_output(out):
        raise ConversionError(
            f"--out {out} is not empty and does not look like an earlier output of this script "
            f"({', '.join(entries[:3])}, ...), so --force will not replace it. Delete it yourself if you "
            "mean to, or choose another directory."
        )
    return out


def temporary_output(out, created):
    """<out>.incomplete: all ranks compute the same name; rank 0 creates it. `created` (a list)
    records it, so that on failure main() removes what this run made and nothing else."""
    tmp = out + ".incomplete"
    created.append(tmp)
    if int(os.environ.get("RANK", "0")) == 0:
        if os.path.exists(tmp):  # left over from an interrupted run of this script
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    return tmp


def finish_output(tmp, out):
    """Give the complete output its final name (rank 0 only). With --force the old directory is
    moved aside first and deleted only after the rename."""
    if os.path.isdir(out) and os.listdir(out):
        old = out + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    fd = os.open(os.path.dirname(out), os.O_RDONLY)  # make the rename itself durable
    os.fsync(fd)
    os.close(fd)


def root_cause(exc):
    """torch.distributed.checkpoint wraps every rank's exception in a CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return root_cause(next(iter(failures.values()))[0])
    return exc


INTERRUPTED = "interrupted; the partial output {out}.incomplete was removed."


def error_message(exc, out):
    """(exit code, one-paragraph message) for the failures a user can fix; None for bugs."""
    exc = root_cause(exc)
    if isinstance(exc, KeyboardInterrupt):
        return 130, INTERRUPTED.format(out=out)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return 2, (
            f"disk full while writing {out} ({exc.filename or 'output file'}): the partial output "
            f"{out}.incomplete was removed and nothing else was touched. Free space on that disk "
            "(the output needs about the size of the input weights in the chosen --dtype) or write "
            "--out elsewhere."
        )
    if isinstance(exc, (ConversionError, UnsupportedModelError)):
        return 2, str(exc)
    if isinstance(exc, OSError):
        return 2, (
            f"{exc.strerror or exc}: {exc.filename or ''}. The partial output {out}.incomplete (if "
            f"any) was removed; {out} itself was not touched."
        )
    if type(exc).__name__ == "CheckpointingException":  # megatron's loader: a checkpoint/config mismatch
        return 2, f"the checkpoint does not match config.json: {exc}"
    return None


def read_hf_spec(config_dir):
    """HFModelSpec of config_dir/config.json; unreadable or unsupported -> a message."""
    from common.model.bridge import parse_hf_config

    path = os.path.join(config_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{config_dir} has no config.json: pass a HuggingFace model directory.")
    try:
        with open(path) as f:
            spec = parse_hf_config(json.load(f))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e}).") from None
    except KeyError as e:
        raise ConversionError(f"{path} lacks the field {e}, which the bridge needs.") from None
    return spec


def check_tool_layout(
    spec,
    world_size,
    tp=1,
    pp=1,
    vpp=None,
    ep=1,
    etp=1,
    first_stage_layers=None,
    last_stage_layers=None,
    flag_prefix="--",
):
    """The offline tools' parallel layout: shapes that split, and a process count it fits
    (TP x PP for the dense part; each stage's ranks also split into ETP x EP for the experts)."""
    from common.model.bridge import check_parallel_layout

    try:
        check_parallel_layout(
            spec,
            tp=tp,
            pp=pp,
            vpp=vpp,
            ep=ep,
            etp=etp,
            first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers,
        )
    except ValueError as e:
        raise ConversionError(f"{flag_prefix}layout: {e}") from None
    needed = math.lcm(tp, ep * etp) * pp
    if world_size % needed:
        raise ConversionError(
            f"--tp {tp} --pp {pp} --ep {ep} --etp {etp} needs a multiple of {needed} processes "
            f"(running {world_size}): torchrun --nproc_per_node {needed} ..."
        )


def run_cli(run, args):
    """Run `run(args, created)` as a command-line tool: on failure remove the outputs it
    created (rank 0), turn the failures a user can fix into (exit code, one paragraph, no
    traceback), re-raise bugs. Returns the exit code.

    Ctrl-C (SIGINT) is exit code 130 and one line, whatever it interrupted: it is recorded as it
    arrives, because the KeyboardInterrupt may not survive the code it lands in (inside
    torch.save's zip writer it becomes a RuntimeError "unexpected pos" as the file is closed)."""
    out, created, sigints = os.path.abspath(args.out), [], []
    owns_process_group = not torch.distributed.is_initialized()  # (main() may run inside a test)

    def on_sigint(signum, frame):
        sigints.append(signum)
        raise KeyboardInterrupt

    in_main_thread = threading.current_thread() is threading.main_thread()  # (signal handlers live there)
    previous = signal.signal(signal.SIGINT, on_sigint) if in_main_thread else None
    try:
        code = run(args, created)
    except BaseException as e:  # KeyboardInterrupt and DCP's CheckpointException (a BaseException) too
        if int(os.environ.get("RANK", "0")) == 0:
            for path in created:
                shutil.rmtree(path, ignore_errors=True)
        known = (130, INTERRUPTED.format(out=out)) if sigints else error_message(e, out)
        if known is None:
            raise
        code, message = known
        print0(f"error: {message}")
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
        if owns_process_group and torch.distributed.is_initialized():
            try:
                destroy_distributed()
            except KeyboardInterrupt:  # the work is over (written and renamed, or removed): nothing to stop
                pass
    return code


def run_training(main):
    """Run a training script's main(). A mistake found after start-up (common.preflight's
    UsageError: all prompts too long, ...; NaN weights: common.model.weights_load's WeightsError), a
    non-finite loss, gradient or logprob (common.guard's NonFiniteError), a checkpoint that
    could not be written (a full disk: common.checkpoint_io's CheckpointWriteError) or a first
    update that --check-on-policy finds off-policy (common.guard's OffPolicyError) ends the run
    with one message from rank 0 and exit code 2, 3, 4 or 5; every rank raises these alike, so
    every rank leaves. Bugs keep their traceback; with vLLM loaded the process then ends with os._exit(1), as
    an in-process engine can block interpreter exit: the rank would live on and the others wait for it in
    their next collective with nothing said, where torchrun ends them once it sees this one exit."""
    from common.model.weights_load import WeightsError
    from common.rollout.remote import close_all
    from common.train.checkpoint_io import CheckpointWriteError
    from common.train.guard import NonFiniteError, OffPolicyError, UsageError

    prog = os.path.basename(sys.argv[0])
    try:
        main()
        return
    except (UsageError, WeightsError) as e:  # (NaN weights: found while loading them)
        code, message = 2, f"{prog}: error: {e}"
    except NonFiniteError as e:
        code, message = 3, f"{prog}: stopped: {e}"
    except CheckpointWriteError as e:
        code, message = 4, f"{prog}: stopped: {e}"
    except OffPolicyError as e:  # --check-on-policy, once the step's metrics and checkpoint are written
        code, message = 5, f"{prog}: stopped: {e}"
    except Exception:
        close_all()  # --rollout-gpus: the engine ranks stop too
        if "vllm" not in sys.modules:
            raise
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    close_all()
    if launcher_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: an in-process vLLM engine can block interpreter exit


def summary_number(value):
    """A metric as the closing summary prints it (a JSON number): 4 decimals, or 2 significant
    digits in exponent notation below 1e-3 (a learning rate of 1e-06 is `1.0e-06`, not 0.0)."""
    value = value.item() if hasattr(value, "item") else value  # (a tensor or numpy scalar)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return json.dumps(value)
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.1e}"
    return json.dumps(round(value, 4))


def finish_training(writer, logger, *, summary, exit_hard):
    """The end of a training script, all ranks: wait for the last checkpoint save and publish
    it (CheckpointWriter.wait), close the metrics,
    print the last step's metrics (summary; None: nothing was trained, e.g. a resume of a
    finished run) and a closing line naming the last checkpoint this run wrote and the
    merge_to_hf.py command that exports it, then leave. exit_hard (with a vLLM engine): os._exit once every rank is
    here, because vLLM 0.26's in-process engine can block interpreter exit (a 1-GPU run hung
    after its last step, docs/gpu.md); everything is written by then."""
    import torch.distributed as dist

    from common.rollout.remote import close_all

    writer.wait()
    logger.close()
    close_all()  # --rollout-gpus: the engine ranks stop
    if summary is not None:
        print0("{" + ", ".join(f"{json.dumps(k)}: {summary_number(v)}" for k, v in summary.items()) + "}")
    if writer.last.get("dir"):  # the closing line: where the weights are, and how to export them
        step_dir = writer.last["dir"]
        run_dir = os.path.dirname(os.path.dirname(os.path.normpath(step_dir)))
        hf_dir = os.path.join(run_dir, f"hf-{os.path.basename(os.path.normpath(step_dir))}")
        print0(f"last checkpoint: {step_dir}; export it: python merge_to_hf.py --ckpt {step_dir} --out {hf_dir}")
    if exit_hard:
        dist.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    destroy_distributed()


def finish_evaluation(*, exit_hard):
    """The end of train_grpo.py --eval-only, all ranks: leave as finish_training does (exit_hard:
    os._exit once every rank is here, for vLLM's in-process engine)."""
    import torch.distributed as dist

    from common.rollout.remote import close_all

    close_all()  # --rollout-gpus: the engine ranks stop
    if exit_hard:
        dist.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    destroy_distributed()
