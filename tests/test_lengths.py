"""A benchmark's response lengths (common/rollout/lengths.py) and the engine that honours them.

.venv/bin/python -m pytest -q tests/test_lengths.py

- the spec grammar: what each spec parses to, and one-line errors for bad ones;
- the draws: fixed and clipped values by hand, uniform reaching both ends, the lognormal's
  mean and median (exp(mu)) over many draws, the same draws for the same (seed, step, round)
  and other draws otherwise;
- HFEngine.generate(response_lengths=...): every sample exactly its length even when every
  token of the vocabulary is an EOS, and the tokens those of the unconstrained sampling cut there;
- train_grpo.py --bench-response-lengths: a bad spec, one longer than --max-new-tokens, or one
  with --load-rollouts is refused at parse time (exit 2, one line).
(bench/e2e.py, which runs the flag end to end: tests/test_bench.py.)
"""

import statistics

import pytest

from common.rollout.lengths import LengthSpec, draw_lengths, parse_lengths

LOGNORMAL = "lognormal:mean=1000,sigma=0.6,min=16,max=3968"


def test_specs_parse():
    assert parse_lengths("fixed:512") == LengthSpec("fixed", 512, 512)
    assert parse_lengths("uniform:min=16,max=2048") == LengthSpec("uniform", 16, 2048)
    assert parse_lengths(LOGNORMAL) == LengthSpec("lognormal", 16, 3968, mean=1000.0, sigma=0.6)
    assert parse_lengths("lognormal:mean=50,sigma=0.5,max=99").low == 1  # min defaults to 1
    assert parse_lengths("fixed:64", max_tokens=64).high == 64


@pytest.mark.parametrize(
    "text,message",
    [
        ("normal:mean=3", "expected one of fixed, uniform, lognormal"),
        ("fixed", "expected one of"),
        ("fixed:0", "fixed:L needs a whole number L >= 1"),
        ("fixed:1.5", "fixed:L needs a whole number"),
        ("uniform:min=5", "uniform needs max"),
        ("uniform:min=9,max=4", "1 <= min <= max"),
        ("uniform:min=1.5,max=4", "whole numbers"),
        ("lognormal:mean=100,max=400", "lognormal needs sigma"),
        ("lognormal:mean=100,sigma=0.5,max=400,mode=3", "'mode=3' is not key=value of lognormal's"),
        ("lognormal:mean=-1,sigma=0.5,max=400", "mean > 0"),
        ("lognormal:mean=abc,sigma=0.5,max=400", "mean='abc' is not a number"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_lengths(text)
    assert "\n" not in str(e.value)


def test_longer_than_max_tokens_is_refused():
    with pytest.raises(ValueError, match="draws up to 3968 tokens, above --max-new-tokens 1024: raise --max-new"):
        parse_lengths(LOGNORMAL, max_tokens=1024)


def test_draws_by_hand():
    assert draw_lengths("fixed:7", 3, 2, seed=0, step=0) == [[7, 7], [7, 7], [7, 7]]
    # sigma 0: every draw is the mean (exp(ln M)), then clipped to [min, max]
    assert draw_lengths("lognormal:mean=300,sigma=0,max=400", 2, 2, seed=0, step=0) == [[300, 300], [300, 300]]
    assert draw_lengths("lognormal:mean=300,sigma=0,max=200", 1, 3, seed=0, step=0) == [[200, 200, 200]]
    assert draw_lengths("lognormal:mean=3,sigma=0,min=10,max=20", 1, 1, seed=0, step=0) == [[10]]
    flat = [n for row in draw_lengths("uniform:min=3,max=6", 100, 10, seed=1, step=0) for n in row]
    assert set(flat) == {3, 4, 5, 6}  # both ends reached, nothing outside


def test_lognormal_mean_and_median():
    """mean=M is the mean before clipping (mu = ln M - sigma^2 / 2): 20,000 draws with a cap far
    above them average M within 1.5% (the standard error is 0.47%), their median is exp(mu)."""
    flat = [
        n for row in draw_lengths("lognormal:mean=1000,sigma=0.6,max=100000", 200, 100, seed=3, step=0) for n in row
    ]
    assert statistics.mean(flat) == pytest.approx(1000, rel=0.015)
    assert statistics.median(flat) == pytest.approx(1000 * 2.718281828 ** (-0.18), rel=0.02)
    capped = [n for row in draw_lengths(LOGNORMAL, 200, 100, seed=3, step=0) for n in row]
    assert min(capped) >= 16 and max(capped) == 3968  # 0.5% of draws are above 3968 before the clip


def test_draws_depend_on_seed_step_and_round_only():
    base = draw_lengths(LOGNORMAL, 4, 8, seed=5, step=2, round_=1)
    assert draw_lengths(parse_lengths(LOGNORMAL), 4, 8, seed=5, step=2, round_=1) == base  # text or spec: the same
    for other in (dict(seed=6, step=2, round_=1), dict(seed=5, step=3, round_=1), dict(seed=5, step=2, round_=0)):
        assert draw_lengths(LOGNORMAL, 4, 8, **other) != base
    assert len(base) == 4 and all(len(row) == 8 for row in base)


def test_hf_engine_exact_lengths(tmp_path):
    from common.rollout.hf_engine import HFEngine
    from common.run.embedded import TOKENIZER_SIZE, write_embedded_model

    model_dir = write_embedded_model(str(tmp_path / "model"))
    prompts, lengths = [[5, 17, 42], [7, 8, 9, 10], [99]], [3, 9, 1, 12, 5, 7]  # 3 prompts x 2 samples
    kwargs = dict(n=2, temperature=1.0, top_p=1.0, seed=5)
    free = HFEngine(model_dir, eos_token_ids=[]).generate(prompts, max_tokens=12, **kwargs)
    # every id is an EOS: unconstrained, each sample stops at its first token
    all_eos = HFEngine(model_dir, eos_token_ids=list(range(TOKENIZER_SIZE)))
    assert [len(s.response_ids) for s in all_eos.generate(prompts, max_tokens=12, **kwargs)] == [1] * 6
    exact = all_eos.generate(prompts, max_tokens=1, response_lengths=lengths, **kwargs)  # max_tokens unused
    assert [len(s.response_ids) for s in exact] == lengths
    assert [len(s.response_logprobs) for s in exact] == lengths
    assert {s.finish_reason for s in exact} == {"length"}
    assert [s.prompt_ids for s in exact] == [p for p in prompts for _ in range(2)]  # prompt-major
    # the same sampling, cut at each sample's length
    assert [s.response_ids for s in exact] == [f.response_ids[:n] for f, n in zip(free, lengths)]
    assert [s.response_logprobs for s in exact] == [f.response_logprobs[:n] for f, n in zip(free, lengths)]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--bench-response-lengths", "fixed:0"], "fixed:L needs a whole number L >= 1"),
        (["--bench-response-lengths", "fixed:64", "--max-new-tokens", "32"], "above --max-new-tokens 32"),
        (
            ["--bench-response-lengths", "fixed:8", "--max-new-tokens", "8", "--load-rollouts", "x"],
            "not with --load-rollouts",
        ),
    ],
)
def test_train_grpo_refuses_bad_specs(flags, message, capsys):
    import train_grpo

    with pytest.raises(SystemExit) as e:
        train_grpo.parse_args(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and ": error: --" in err
