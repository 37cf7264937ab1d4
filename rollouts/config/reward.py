"""[reward] section: how a scored reward becomes the final reward the trainer reads.

Applied on the rollout side, to each batch's kept groups (`rewards.shaping.shape_rewards`), so a
sample leaves the rollout manager with its final reward; the scored one stays in
`metadata["raw_reward"]` (what the `reward/*` metrics report). Not part of `[algorithm]`: an
algorithm schedule cannot change it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

RewardTransform = Literal["absolute", "relative", "pareto"]  # as scored | rank | vector: Pareto
RewardScope = Literal["group", "batch"]  # where relative / pareto compare
ParetoMode = Literal["rank", "distance"]  # 1 / (1 + Pareto rank) | -distance to the front
RewardNorm = Literal["none", "group", "batch"]  # (r - mean) / (std + 1e-6) over the group / batch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LengthShapingConfig(_Section):
    """[reward.length]: DAPO's soft overlong penalty and the efficiency bonus."""

    KEY: ClassVar[str] = "reward.length"

    max_length: int = 0  # the response length the penalty reaches -overlong_penalty
    overlong_buffer: int = 0  # > 0: the penalty grows over the last N tokens before max_length
    overlong_penalty: float = 1.0
    efficiency_coef: float = 0.0  # > 0: bonus coef * (1 - len / max_length) when r > 0

    @property
    def enabled(self) -> bool:
        return self.overlong_buffer > 0 or self.efficiency_coef > 0.0

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.overlong_buffer >= 0, "reward.length.overlong_buffer: must be >= 0")
        _check(p, self.efficiency_coef >= 0.0, "reward.length.efficiency_coef: must be >= 0")
        _check(
            p,
            not self.enabled or self.max_length >= max(self.overlong_buffer, 1),
            f"reward.length.max_length = {self.max_length}: must be >= overlong_buffer (and "
            ">= 1) when the overlong penalty or efficiency bonus is on",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig(_Section):
    """[reward]: vector -> scalar, absolute or relative, length terms, normalisation."""

    KEY: ClassVar[str] = "reward"

    transform: RewardTransform = "absolute"
    scope: RewardScope = "group"
    weights: list[float] = dataclasses.field(default_factory=list)  # vector -> weighted sum
    pareto_mode: ParetoMode = "rank"
    norm: RewardNorm = "none"
    length: LengthShapingConfig = dataclasses.field(default_factory=LengthShapingConfig)
