"""Rule-based rewards: a response string and a reference answer -> a float in [0, 1].

  math_reward(response, answer)       GSM8K / MATH style: the final answer is the last
                                      \\boxed{...}, else the text after '####', else the last
                                      number; equal as strings, as numbers, or by math_verify
  synthetic_reward(response, answer)  the synthetic arithmetic task of common/run/data.py:
                                      1 for the right number, partial credit for a number

Neither raises on any input (the policy writes anything), and both are cheap: plain
numbers are compared without sympy, and math_verify runs with a timeout.
"""

import logging
import math
import re
import threading

# A timeout or an unparsable answer is an expected 0 reward, not something to log for every sample.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# -----------------------------------------------------------------------------
# Extracting the final answer

_BOXED = re.compile(r"\\(?:boxed|fbox)")
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def last_boxed(text):
    """Contents of the last complete \\boxed{...} (or \\fbox{...}) of text; None if there is none.

    Braces nest (\\boxed{\\frac{1}{2}}); escaped braces \\{ \\} do not count; an unbalanced
    or empty box is skipped in favour of the one before it. '\\boxed 5' gives '5'.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i == len(text):
            continue
        if text[i] != "{":
            if i == match.end():
                continue  # '\boxedx': another command, not a box
            word = re.match(r"[^\s${}]+", text[i:])  # '\boxed 5': the argument is the next word
            if word:
                return word.group(0)
            continue
        depth = 0
        for j in range(i, len(text)):
            if text[j] in "{}" and text[j - 1] == "\\":
                continue  # \{ or \}: a literal brace of a set
            depth += 1 if text[j] == "{" else -1 if text[j] == "}" else 0
            if depth == 0:
                if text[i + 1 : j].strip():
                    return text[i + 1 : j]
                break
    return None


def after_hashes(text):
    """The rest of the line after the last '####' (GSM8K's final-answer marker), or None."""
    k = text.rfind("####")
    if k < 0:
        return None
    answer = text[k + 4 :].strip().split("\n")[0].strip()
    return answer or None


def last_number(text):
    """The last number of text ('1,000' and '-2.5' included), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


# "The (final) answer is X", "Answer: X": the last such statement of a response
# (mid-sentence only after "the"/"final", so "to answer: we add 3 and 4" is not one)
_STATED = re.compile(
    r"(?:\b(?:final|the)\s+answer\s*(?:is\s*:?|:|=)|^[ \t*#>-]*(?:final\s+)?answer\s*\**\s*:)\s*",
    re.IGNORECASE | re.MULTILINE,
)


def stated_answer(text):
    """X of the last "the answer is X" / "final answer: X" / "Answer: X" of text, or None.

    X is an inline-math span ($...$, \\(...\\)) when one follows, else the rest of the
    sentence: up to a period that ends it ("42. We used 3 steps" -> "42"; "5.00." -> "5.00")
    or the line's end, and a number's unit word dropped ("18 dollars" -> "18"). Markdown bold
    is dropped."""
    matches = list(_STATED.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].replace("**", "").lstrip()
    for start, end in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if rest.startswith(start):
            close = rest.find(end, len(start))
            return rest[len(start) : close].strip() or None if close > 0 else None
    line = rest.split("\n")[0]
    answer = re.match(r"(.*?)(?:\.(?=\s|$)|$)", line).group(1).strip().rstrip(",;:")
    with_unit = re.match(r"([$€£¥₹]?-?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z]", answer)  # "18 dollars" -> "18"
    return (with_unit.group(1) if with_unit else answer) or None


def extract_answer(response, fallback_last_number=True):
    """The final answer of a model response: \\boxed{}, else '####', else a stated answer
    ("the answer is X", "Answer: X"), else (optionally) the last number."""
    answer = last_boxed(response)
    if answer is None:
        answer = after_hashes(response)
    if answer is None:
        answer = stated_answer(response)
    if answer is None and fallback_last_number:
        answer = last_number(response)
    return answer


def extract_reference(answer):
    """The final answer of a reference: a MATH solution (\\boxed), a GSM8K one (####), or itself."""
    ref = last_boxed(answer)
    if ref is None:
        ref = after_hashes(answer)
    if ref is None:
        ref = answer.strip()
    return ref or None


def final_answer(response):
    """The normalised final answer of a math response, or None (majority votes: common/rollout/evaluate.py)."""
    answer = extract_answer(response)
    return normalize(answer) if answer is not None else None


# -----------------------------------------------------------------------------
# Comparing two answers


def normalize(answer):
    """A canonical string: no whitespace, '$' (escaped or not) or currency sign, no LaTeX
    spacing, no trailing '.', 1,000 -> 1000."""
    s = re.sub(r"\\\$|\\[,;:! ]|\\left|\\right|[$€£¥₹]|\s", "", answer)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: (1,2) stays
    s = s.rstrip(".")
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[6:-1]
    return s


def _as_number(s):
    """float(s) for a plain decimal number, else None."""
    return float(s) if _PLAIN_NUMBER.fullmatch(s) else None


MAX_VERIFY_CHARS = 300  # longer answers are compared as strings only: sympy can take forever


def _math_verify_equal(gold, pred, timeout_s):
    """math_verify's verdict on two extracted answers; False when it cannot parse them.

    math_verify's timeout uses signal.alarm, which only works in the main thread. In other
    threads it runs without one, so answers that can make sympy run for minutes (power
    towers like 9^{9^9}, factorials) are refused there.
    """
    if len(gold) > MAX_VERIFY_CHARS or len(pred) > MAX_VERIFY_CHARS:
        return False
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread and any(s.count("^") > 1 or "!" in s for s in (gold, pred)):
        return False
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        return False
    timeout = timeout_s if in_main_thread else None
    try:
        # Wrapping in \boxed{} makes math_verify read the string as one LaTeX answer
        # (bare '\frac{1}{2}' or '\sqrt{2}/2' parse to nothing otherwise).
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (Exception, TimeoutException):
        return False


def answers_equal(gold, pred, timeout_s=1):
    """True when two extracted final answers are the same: string, number, then math_verify."""
    gold_norm, pred_norm = normalize(gold), normalize(pred)
    if not gold_norm or not pred_norm:
        return False
    if gold_norm == pred_norm:
        return True
    gold_num, pred_num = _as_number(gold_norm), _as_number(pred_norm)
    if gold_num is not None and pred_num is not None:
        # Both plain numbers (GSM8K): decide here, sympy would only be slower.
        return math.isclose(gold_num, pred_num, rel_tol=1e-9, abs_tol=1e-9)
    return _math_verify_equal(gold_norm, pred_norm, timeout_s)


def math_reward(response, answer, fallback_last_number=True, timeout_s=1):
    """1.0 when the response's final answer equals the reference's, else 0.0.

    response: the model's text. answer: the reference, either the bare answer ('42',
    '\\frac{1}{2}') or a full solution ending in '#### 42' (GSM8K) or containing \\boxed{}
    (MATH). Equivalent forms count (1/2 = 0.5 = \\frac{1}{2}, 1,000 = 1000) via math_verify.
    """
    try:
        pred = extract_answer(str(response), fallback_last_number=fallback_last_number)
        gold = extract_reference(str(answer))
        if pred is None or gold is None:
            return 0.0
        return 1.0 if answers_equal(gold, pred, timeout_s=timeout_s) else 0.0
    except Exception:  # a reward must never stop training; a crash here is a 0
        return 0.0


# -----------------------------------------------------------------------------
# The synthetic task

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")
_CLEAN_END = re.compile(r"\s*(?:<\|[^|]*\|>.*)?", re.DOTALL)  # whitespace, then maybe a special token


def synthetic_answer(response):
    """The synthetic task's answer in a response: its leading number, or None."""
    match = _LEADING_NUMBER.match(str(response))
    return match.group(1) if match else None


def synthetic_reward(response, answer, format_credit=0.1, require_end=False):
    """Reward of the synthetic arithmetic task (common/run/data.py: SyntheticArithmetic).

      1.0            the response's first number (after optional whitespace) is the answer
      format_credit  it starts with a number, but the wrong one
      0.0            it does not start with a number
    With require_end=True the right number earns 1.0 only when nothing but whitespace or a
    special token (<|im_end|>) follows it; '7abc' then earns format_credit.

    Why partial credit: the embedded model starts from random weights and samples ~uniformly
    over 259 byte tokens, so only ~4% of responses start with a digit and almost none are
    right. format_credit makes "answer with a number" learnable first; once the policy
    writes digits, a one-digit answer is right ~1/10 of the time by chance, and the gap
    1.0 vs format_credit drives it to the right number. Keep format_credit small: it is
    the most a policy earns without ever being right.
    """
    try:
        match = _LEADING_NUMBER.match(str(response))
        if match is None:
            return 0.0
        correct = match.group(1) == str(answer).strip()
        if correct and require_end:
            correct = _CLEAN_END.fullmatch(response, match.end()) is not None
        return 1.0 if correct else float(format_credit)
    except Exception:
        return 0.0
