"""Response lengths drawn from a distribution: the rollout of a throughput benchmark.

    lengths = draw_lengths("lognormal:mean=1000,sigma=0.6,min=16,max=3968", 64, 32, seed=1234, step=0)
    # 64 lists of 32: sample j of prompt i gets exactly lengths[i][j] tokens, EOS ignored

On random weights EOS comes by chance, so the response lengths of a run say nothing of a real
one. A benchmark of whole steps (train_grpo.py --bench-response-lengths, bench/e2e.py) sets
them instead: every sample's length is drawn here and handed to the rollout engine
(RolloutEngine.generate(response_lengths=...)), which samples exactly that many tokens (vLLM:
max_tokens=L, ignore_eos, no stop tokens). The trainer's passes then see the same lengths.

Specs (token counts; a draw is rounded to an integer, then clipped to [min, max]):
    fixed:L                                 every response L tokens
    uniform:min=A,max=B                     integers uniform in [A, B]
    lognormal:mean=M,sigma=S,max=B[,min=A]  exp(N(mu, S^2)) with mu = ln M - S^2 / 2, so that M is the mean
                                            before clipping (sigma 0.6: 0.5% above 4 M); min defaults to 1
The draws depend on the spec and (seed, step, round) alone: every rank draws the same, and a
benchmark's report recomputes them (bench/e2e.py). Pure Python (random.Random seeded by a
string hashes it with SHA-512: the same numbers on every platform and Python 3 version).
"""

import math
import random
from dataclasses import dataclass

KINDS = {"fixed": (), "uniform": ("min", "max"), "lognormal": ("mean", "sigma", "max")}  # kind -> its required keys


@dataclass(frozen=True)
class LengthSpec:
    kind: str  # a key of KINDS
    low: int  # every length in [low, high]
    high: int
    mean: float = 0.0  # lognormal: the mean before clipping
    sigma: float = 0.0  # lognormal: the std of the log


def parse_lengths(text, max_tokens=None):
    """The LengthSpec of a spec string (module docstring); ValueError with what is wrong and how
    to write it. max_tokens: the largest length the run allows (--max-new-tokens)."""
    usage = "e.g. fixed:512, uniform:min=16,max=2048 or lognormal:mean=1000,sigma=0.6,min=16,max=3968"
    kind, _, rest = text.partition(":")
    if kind not in KINDS or not rest:
        raise ValueError(
            f"--bench-response-lengths {text!r}: expected one of {', '.join(KINDS)} with parameters, {usage}"
        )
    if kind == "fixed":
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"--bench-response-lengths {text!r}: fixed:L needs a whole number L >= 1, {usage}")
        spec = LengthSpec(kind, int(rest), int(rest))
    else:
        fields = {}
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            allowed = KINDS[kind] + ("min",)
            if not eq or key not in allowed:
                raise ValueError(
                    f"--bench-response-lengths {text!r}: {item!r} is not key=value of {kind}'s {', '.join(allowed)}"
                )
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"--bench-response-lengths {text!r}: {key}={value!r} is not a number") from None
        missing = [key for key in KINDS[kind] if key not in fields]
        if missing:
            raise ValueError(f"--bench-response-lengths {text!r}: {kind} needs {', '.join(missing)}, {usage}")
        low, high = fields.get("min", 1.0), fields["max"]
        if not (low == int(low) and high == int(high) and 1 <= low <= high):
            raise ValueError(f"--bench-response-lengths {text!r}: min and max must be whole numbers, 1 <= min <= max")
        if kind == "lognormal" and not (fields["mean"] > 0 and fields["sigma"] >= 0 and math.isfinite(fields["sigma"])):
            raise ValueError(f"--bench-response-lengths {text!r}: lognormal needs mean > 0 and sigma >= 0")
        spec = LengthSpec(kind, int(low), int(high), fields.get("mean", 0.0), fields.get("sigma", 0.0))
    if max_tokens is not None and spec.high > max_tokens:
        raise ValueError(
            f"--bench-response-lengths {text!r} draws up to {spec.high} tokens, above --max-new-tokens {max_tokens}: "
            f"raise --max-new-tokens to {spec.high} (prompt + response must fit the model's positions)"
        )
    return spec


def draw_lengths(spec, num_prompts, group, *, seed, step, round_=0):
    """num_prompts lists of `group` lengths: those of sample j of prompt i of the step's sampling
    round `round_` (spec: a LengthSpec or its text). The same on every rank and in every run of
    the same seed."""
    spec = parse_lengths(spec) if isinstance(spec, str) else spec
    rng = random.Random(f"response-lengths/{seed}/{step}/{round_}")
    mu = math.log(spec.mean) - spec.sigma**2 / 2 if spec.kind == "lognormal" else 0.0

    def one():
        if spec.kind == "fixed":
            return spec.low
        if spec.kind == "uniform":
            return rng.randint(spec.low, spec.high)
        return min(spec.high, max(spec.low, round(rng.lognormvariate(mu, spec.sigma))))

    return [[one() for _ in range(group)] for _ in range(num_prompts)]
