"""Answer verifiers for verifiable-reward tasks: final-answer extraction, exact and numeric match.

The response text is read from `sample.metadata["response_text"]` when the rollout stored it, else
decoded from the response tokens with the `decode` function a reward is built with
(`tokenizer_decoder(tokenizer)`). The gold answer is `sample.label`. A response with no
extractable answer scores 0 (a wrong answer); a sample with no text and no decoder, or no label,
is an ERROR (it raises, so the sample is marked FAILED), never a silent 0.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from rollouts.types import Sample

Decode = Callable[[Sequence[int]], str]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_MARKERS = (
    re.compile(r"####"),
    re.compile(r"answer\s*(?:is|:)", re.IGNORECASE),
)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no answer


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked response, or None.

    In order: the last \\boxed{...}; the text after the last "####"; after the last "Answer:" /
    "answer is" (case-insensitive; the first number there when there is one); else the last
    number in the text.
    """
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    for marker in _ANSWER_MARKERS:
        found = list(marker.finditer(text))
        if found:
            rest = text[found[-1].end() :].split("\n", 1)[0].strip()
            number = _NUMBER.search(rest)
            return number.group(0) if number else (rest.rstrip(".").strip() or None)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Case, spaces, $...$, a trailing period, thousands commas and \\text{} do not count."""
    s = answer.strip().rstrip(".").strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.rstrip(".").strip().lower()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return " ".join(s.split())


def parse_number(answer: str) -> float | None:
    """A float from "12", "-3.5", "1,234", "3/4" (after normalisation), else None."""
    s = normalize_answer(answer).replace(",", "")
    try:
        return float(Fraction(s)) if "/" in s else float(s)
    except (ValueError, ZeroDivisionError):
        return None


def tokenizer_decoder(tokenizer: Any) -> Decode:
    """A `decode` for rewards: the tokenizer's decode without special tokens."""
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def response_text(sample: Sample, decode: Decode | None = None) -> str:
    """The sample's response as text (metadata "response_text", else decoded tokens)."""
    text = sample.metadata.get("response_text")
    if isinstance(text, str):
        return text
    if decode is None:
        raise ValueError(
            f"sample {sample.index}: no metadata['response_text'] and no decode function; "
            "build the reward with decode=tokenizer_decoder(tokenizer)"
        )
    return decode(list(sample.response_tokens))


def _gold(sample: Sample) -> str:
    if sample.label is None:
        raise ValueError(f"sample {sample.index}: no label (gold answer) to verify against")
    return str(sample.label)


def exact_match_reward(sample: Sample, decode: Decode | None = None) -> float:
    """1.0 when the extracted final answer equals the label after normalisation, else 0.0."""
    gold = _gold(sample)
    answer = extract_final_answer(response_text(sample, decode))
    if answer is None:
        return 0.0
    return 1.0 if normalize_answer(answer) == normalize_answer(gold) else 0.0


def numeric_match(answer: str | None, gold: str, tol: float) -> bool:
    """Both parse as numbers and |a - g| <= tol (an absolute tolerance)."""
    if answer is None:
        return False
    a, g = parse_number(answer), parse_number(gold)
    if g is None:
        raise ValueError(f"label {gold!r} is not a number: use exact_match_reward")
    return a is not None and abs(a - g) <= tol


def numeric_reward(tol: float = 1e-6, decode: Decode | None = None) -> Callable[[Sample], float]:
    """A reward function: 1.0 when the final answer is numerically within `tol` of the label."""
    assert tol >= 0.0, f"{tol=} must be >= 0"

    def reward(sample: Sample) -> float:
        answer = extract_final_answer(response_text(sample, decode))
        return 1.0 if numeric_match(answer, _gold(sample), tol) else 0.0

    return reward


def make_exact_match_reward(decode: Decode | None = None) -> Callable[[Sample], float]:
    """`exact_match_reward` bound to a decoder (for samples without metadata text)."""
    return functools.partial(exact_match_reward, decode=decode)
