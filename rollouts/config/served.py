"""[teacher] and [judge]: models served by engines of their own that are never trained and never
synced. The teacher scores the student's tokens (on-policy distillation, `algorithm.advantage =
"distill"`); the judge grades finished samples (`rollout.reward_fn = "judge"`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from rollouts.config.base import _check, _Section
from rollouts.config.model import ModelSourceName
from rollouts.config.rollout import EnginesConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServedModelConfig(_Section):
    """A model and the engines that serve it ([<name>.engines], [<name>.engines.builtin]):
    built-in ones started here on `path`, or SGLang / vLLM servers already serving it at
    `engines.urls`. Either way `path` is what the run proves they serve (the content check at
    start) and where its tokenizer is read."""

    KEY: ClassVar[str] = ""

    path: str = ""  # an HF model directory; "" (and no source) = none
    source: ModelSourceName = ""  # a packaged real model (converted on first use), as model.source
    max_concurrency: int = 16  # requests in flight at once
    # the content check's tolerance at start; 0 = by the dtype the built-in engines serve
    # (servers at URLs: float32's; a bf16 server needs the bf16 one, 0.2)
    check_tolerance: float = 0.0
    engines: EnginesConfig = dataclasses.field(default_factory=EnginesConfig)

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.source)

    def problems(self) -> list[str]:
        k = self.KEY
        p: list[str] = []
        _check(p, self.max_concurrency >= 1, f"{k}.max_concurrency: must be >= 1")
        _check(p, self.check_tolerance >= 0, f"{k}.check_tolerance: must be >= 0 (0 = auto)")
        _check(
            p,
            self.engines.sleep_level == 0,
            f"{k}.engines.sleep_level: a {k}'s engines do not sleep (the loop sleeps the "
            "policy's); set it to 0",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TeacherConfig(ServedModelConfig):
    """[teacher]: the model whose logprobs of the student's own tokens distillation learns
    from. Its tokenizer must be the student's."""

    KEY: ClassVar[str] = "teacher"

    evaluate: bool = True  # the teacher's held-out accuracy, measured once before RL


DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Reply with one line: 'Score: N', N from 0 (wrong) to 10 (right)."
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JudgeConfig(ServedModelConfig):
    """[judge]: an LLM that grades each finished sample (`rollout.reward_fn = "judge"`).

    The judge is asked, in its own chat template, `template` with {question} (the prompt's last
    user message, or the prompt), {response} (the sample's text) and {reference} (its label)
    filled in; it answers greedily in at most `max_new_tokens`; the first match of `pattern`
    (its first group, a number) scaled from [score_min, score_max] to [0, 1] is the reward. An
    answer with no match, or a number outside the range, fails the sample (`reward/unparsed`):
    counted, never a 0."""

    KEY: ClassVar[str] = "judge"

    template: str = DEFAULT_JUDGE_TEMPLATE
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    score_min: float = 0.0
    score_max: float = 10.0
    max_new_tokens: int = 16
    chat: bool = True  # the judge's chat template around the question; false: the plain text

    def problems(self) -> list[str]:
        import re

        p = ServedModelConfig.problems(self)
        _check(p, self.score_max > self.score_min, "judge.score_max: must be > judge.score_min")
        _check(p, self.max_new_tokens >= 1, "judge.max_new_tokens: must be >= 1")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            groups = -1
            p.append(f"judge.pattern = {self.pattern!r}: not a regular expression ({e})")
        _check(
            p,
            groups != 0,
            f"judge.pattern = {self.pattern!r}: needs a group around the score, e.g. "
            r"'Score:\s*(\d+)'",
        )
        missing = [k for k in ("{response}",) if k not in self.template]
        _check(
            p,
            not missing,
            f"judge.template: has no {missing} placeholder; the judge must see the response",
        )
        return p
