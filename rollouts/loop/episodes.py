"""Per-step figures of multi-turn episodes, read from what the agent loop records.

`rollout/agent.py` leaves in each sample's metadata: `turns`, `episode_end` (why the episode
ended), `episode_tokens` (prompt and all), `sampled_tokens` (the trained ones) and `env_info`
(the environment's last info: `tool_calls`, `invalid_tool_calls`, `success`, ...). A step's
figures are their means over the step's episodes, and a count per way of ending.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollouts.types import Sample

EPISODE_ENDS = ("answer", "budget", "max_turns", "context", "turn_length", "aborted", "failed")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`agent/*` figures of the samples the agent loop made; {} when there are none."""
    episodes = [s for s in samples if "episode_end" in s.metadata]
    if not episodes:
        return {}
    infos = [s.metadata.get("env_info") or {} for s in episodes]
    calls = [float(i.get("tool_calls", 0)) for i in infos]
    invalid = [float(i.get("invalid_tool_calls", 0)) for i in infos]
    out = {
        "agent/episodes": float(len(episodes)),
        "agent/turns_mean": _mean([float(s.metadata["turns"]) for s in episodes]),
        "agent/tokens_mean": _mean([float(s.metadata["episode_tokens"]) for s in episodes]),
        "agent/sampled_tokens_mean": _mean([float(s.metadata["sampled_tokens"]) for s in episodes]),
        "agent/tool_calls_mean": _mean(calls),
        "agent/invalid_calls_mean": _mean(invalid),
        "agent/tool_calls": sum(calls),
        "agent/invalid_calls": sum(invalid),
    }
    if any("success" in step for s in episodes for step in s.metadata.get("env_infos", ())):
        out["agent/success"] = _mean([float(i.get("success") is True) for i in infos])
    ends = Counter(str(s.metadata["episode_end"]) for s in episodes)
    for end in (*EPISODE_ENDS, *sorted(set(ends) - set(EPISODE_ENDS))):
        out[f"agent/end/{end}"] = float(ends[end])
    assert sum(ends.values()) == len(episodes), f"{ends=} for {len(episodes)} episodes"
    return out
