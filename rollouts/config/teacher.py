"""[teacher]: a model served by engines of its own that scores the student's samples (on-policy
distillation, `algorithm.advantage = "distill"`). It is never trained and never synced."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from rollouts.config.base import _check, _Section
from rollouts.config.model import ModelSourceName
from rollouts.config.rollout import EnginesConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TeacherConfig(_Section):
    """[teacher] with [teacher.engines] (and [teacher.engines.builtin]): the teacher's model and
    the engines that serve it: built-in ones started here on `path`, or SGLang / vLLM servers
    already serving it at `engines.urls`. Either way `path` is what the run proves they serve
    (the content check at start) and where its tokenizer is read (it must be the student's)."""

    KEY: ClassVar[str] = "teacher"

    path: str = ""  # an HF model directory; "" = no teacher
    source: ModelSourceName = ""  # a packaged real model (converted on first use), as model.source
    # samples scored at once (each one prompt-logprobs request over its whole sequence)
    max_concurrency: int = 16
    evaluate: bool = True  # the teacher's held-out accuracy, measured once before RL
    # the content check's tolerance at start; 0 = by the dtype the built-in engines serve
    # (servers at URLs: float32's; a bf16 server needs the bf16 one, 0.2)
    check_tolerance: float = 0.0
    engines: EnginesConfig = dataclasses.field(default_factory=EnginesConfig)

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.source)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.max_concurrency >= 1, "teacher.max_concurrency: must be >= 1")
        _check(p, self.check_tolerance >= 0, "teacher.check_tolerance: must be >= 0 (0 = auto)")
        _check(
            p,
            self.engines.sleep_level == 0,
            "teacher.engines.sleep_level: the teacher's engines do not sleep (the loop sleeps "
            "the policy's); set it to 0",
        )
        return p
