"""Run safety inside the training loop: stop at a step boundary when asked to, and stop
before a non-finite number reaches the weights.

    control = RunControl(save_every=..., save_every_minutes=..., steps=...)
    for step in ...:
        ...                                    # schedule.train_step checks loss and gradients
        save, stop = control.step_end(step, device)   # all ranks: one tiny all-reduce
        if save: <save a checkpoint>
        if stop: break                         # SIGTERM / SIGINT / SIGUSR1 arrived

Signals. SIGTERM (torchrun's and Slurm's shutdown signal), SIGINT (Ctrl-C) and SIGUSR1
(launch/slurm.sh: the time limit is near) do not kill the run: the current step finishes,
a checkpoint is saved, and the program exits 0 with a line saying how to continue
(--resume). A second Ctrl-C aborts at once. The ranks may receive a signal at different
moments, so the decision is taken together, at the end of each step, with one all-reduce
of a flag: every rank saves and stops after the same step.

Non-finite numbers. A NaN or Inf in the logprobs, the loss or the gradients stops the run
with a NonFiniteError naming the step and the quantity, before the optimizer step: the
weights (and so every checkpoint) stay as they were after the last good step.

Stalls. With stall_minutes (--stall-dump-minutes) a step that runs longer than that (a collective one
rank never joins, a hung engine) appends every thread's Python stack of each rank to
<out>/stacks/rank<R>.txt, once per stalled step, and the run goes on (StallWatch, a daemon thread whose
clock restarts at every step's end; RunControl.close stops it). No file is written while no step stalls.

On-policy check. --check-on-policy BOUND stops the run (OffPolicyError, exit 5) after the step
of its first update when that update was not on-policy (on_policy_failure), once the step's
metrics and checkpoint are written.
"""

import math
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class UsageError(ValueError):
    """A mistake in the arguments or inputs that the user can fix; the message says how."""


class NonFiniteError(RuntimeError):
    """A NaN/Inf where the training math needs finite numbers; raised on every rank alike."""


class OffPolicyError(RuntimeError):
    """--check-on-policy: the run's first update was not on-policy; raised on every rank alike."""


class RunControl:
    """When to save and when to stop, decided the same way on every rank."""

    def __init__(self, save_every=0, save_every_minutes=0.0, steps=None, stall_minutes=0.0, out=None):
        self.save_every, self.save_every_minutes, self.steps = save_every, save_every_minutes, steps
        self.signal_name = None  # set by the handler: the first stop signal received
        self._last_save = time.monotonic()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        self._stall = None  # see the module docstring: Stalls
        if stall_minutes > 0 and out is not None:
            self._stall = StallWatch(60 * stall_minutes, os.path.join(out, "stacks", f"rank{_rank()}.txt"))

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # the second Ctrl-C: the user does not want to wait
        if self.signal_name is None:
            self.signal_name = name
            if _rank() == 0:
                print(
                    f"\n{name} received: finishing this step, then saving a checkpoint and exiting "
                    "(Ctrl-C again aborts without saving)",
                    flush=True,
                )

    def step_end(self, step, device):
        """(save, stop) after 0-based `step`. All ranks call this, once per step."""
        due = self.save_every_minutes > 0 and time.monotonic() - self._last_save >= 60 * self.save_every_minutes
        flags = torch.tensor([float(self.signal_name is not None), float(due)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # one rank's signal or clock stops all
        stop, due = bool(flags[0].item()), bool(flags[1].item())
        last = self.steps is not None and step + 1 == self.steps
        save = stop or due or last or (self.save_every > 0 and (step + 1) % self.save_every == 0)
        if save:
            self._last_save = time.monotonic()
        if self._stall is not None:
            self._stall.restart()  # the next step's clock
        return save, stop

    def close(self):
        """After the last step: stop watching for stalls."""
        if self._stall is not None:
            self._stall.stop()
            self._stall = None

    def stop_message(self, step):
        return (
            f"\nstopped by {self.signal_name or 'a signal to another rank'} after step {step + 1}; checkpoint "
            "saved. Continue with the same command plus --resume"
        )


class StallWatch(threading.Thread):
    """Writes every thread's stack to `path` (appended, with a header) when `seconds` pass without a
    restart(), once until the next restart; in Python (sys._current_frames), not faulthandler's C watchdog,
    which crashed a CPU run (SIGSEGV) while threads came and went."""

    def __init__(self, seconds, path):
        super().__init__(name="stall-watch", daemon=True)
        self.seconds, self.path = seconds, path
        self._cond, self._deadline, self._stopped = threading.Condition(), time.monotonic() + seconds, False
        self.start()

    def restart(self):
        with self._cond:
            self._deadline = time.monotonic() + self.seconds
            self._cond.notify()

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self):
        with self._cond:
            while not self._stopped:
                left = self._deadline - time.monotonic() if self._deadline is not None else None
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None  # once per stall: restart() arms it again
                self._write()

    def _write(self):
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [
            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: this step has run longer than {self.seconds / 60:g} min "
            f"(--stall-dump-minutes); rank {_rank()}, pid {os.getpid()}, every thread's stack (most recent call last)\n"
        ]
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():
                lines.append(f"\nthread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write("".join(lines) + "\n")


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def check_finite(what, tensor, mask=None, step=None):
    """Raise NonFiniteError if `tensor` (where mask != 0) holds a NaN or Inf. Local: call it
    on data every rank holds alike (e.g. logprobs after their all-reduce), so that every
    rank raises together."""
    values = tensor if mask is None else tensor[mask.bool()]
    bad = ~torch.isfinite(values)
    if bad.any():
        raise NonFiniteError(f"{_at(step)}{what}: {int(bad.sum())} of {values.numel()} values are NaN/Inf. " + HINTS)


def check_finite_update(model_chunks, metric_dicts, device, step=None):
    """Before an optimizer step: are the losses (the `*loss` keys of this rank's micro-batch metrics) and the
    gradients (DDP's grad buffers of this rank) finite on every rank? Collective: all ranks
    call this; on a failure all raise NonFiniteError, naming the first non-finite gradients."""
    loss_bad = any(not _finite(v) for d in metric_dicts for k, v in d.items() if k.endswith("loss"))
    grads = list(_grads(model_chunks))
    grad_ok = torch.stack([torch.isfinite(g).all() for _, g in grads]).all() if grads else torch.tensor(True)
    flags = torch.stack([torch.tensor(float(loss_bad), device=device), (~grad_ok).float().to(device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    loss_bad, grad_bad = bool(flags[0].item()), bool(flags[1].item())
    if not (loss_bad or grad_bad):
        return
    names = [name for name, g in grads if not torch.isfinite(g).all()]
    if dist.is_initialized() and dist.get_world_size() > 1:  # only on failure: who has which
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        names = sorted({n for ns in every for n in ns})
    what = "the loss" + (" and the gradients" if grad_bad else "") if loss_bad else "the gradients"
    where = f" (non-finite: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""
    raise NonFiniteError(
        f"{_at(step)}{what} {'is' if what == 'the loss' else 'are'} NaN/Inf{where}; no optimizer "
        "step was applied: the weights "
        "are as they were before this update. " + HINTS
    )


def on_policy_failure(metrics, bound, step=None):
    """--check-on-policy BOUND (slime's CI gate, run on the step of the first update): one line saying what
    exceeds the bound, or None. Checked: the first update's mean abs(old - new) logprob before any optimizer
    step (first_update_logprob_err; where the update's own forward is the old policy, GRPO's on-policy steps,
    abs(ppo_kl), exactly 0) and logprob_mismatch, mean abs(engine - trainer) logprob. `metrics` are the step's
    reduced metrics (equal on every rank, so every rank decides alike); a NaN fails."""
    found = {k: metrics[k] for k in ("first_update_logprob_err", "logprob_mismatch") if k in metrics}
    if "first_update_logprob_err" not in found and "ppo_kl" in metrics:
        found["ppo_kl"] = abs(metrics["ppo_kl"])
    over = [f"{name} {value:.3g}" for name, value in found.items() if not value <= bound]
    if not over:
        return None
    return (
        f"{_at(step)}the first update is not on-policy: {', '.join(over)} > --check-on-policy {bound:g}. Usual "
        "causes: a weight sync that did not reach the engine, logprobs at another --temperature, the trainer's "
        "passes disagreeing (dropout, another kernel), or a bound below bf16's rounding (~0.02 of logprob_mismatch)"
    )


def gate_on_policy(metrics, bound, step, flush):
    """--check-on-policy BOUND on the step of the first update: OffPolicyError (exit 5) when on_policy_failure
    finds one, raised after flush() (the step's checkpoint and metrics written)."""
    failed = on_policy_failure(metrics, bound, step)
    if failed:
        flush()
        raise OffPolicyError(failed)


HINTS = (
    "Usual causes: a learning rate too high for this model (--lr), a reward function returning "
    "NaN, fp16/bf16 overflow in a custom loss. The checkpoints in --out/checkpoints (if any) are "
    "from before this step: fix the cause and continue with --resume."
)


def _at(step):
    return "" if step is None else f"step {step + 1}: "


def _finite(value):
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return not isinstance(value, float) or math.isfinite(value)


def _grads(model_chunks):
    """(name, gradient) of every parameter of this rank: DDP's main_grad (a view into its flat
    grad buffer; with the distributed optimizer the slices other DP ranks own hold this rank's
    unreduced part, non-finite whenever the reduced one is), else .grad."""
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                yield (f"chunk{i}." if len(model_chunks) > 1 else "") + name.removeprefix("module."), g
