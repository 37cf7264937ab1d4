"""The gateway's generate function: a user's agent, given a base_url, makes one sample.

`AgentGenerate` (what `rollout.generate_fn = "rollouts.gateway.agent_generate"` becomes; the
driver builds it with `open_agent_generate`) opens a session for the sample, calls the agent
`agent(base_url, prompt, metadata) -> str` (async, or sync in a worker thread), and assembles the
Sample from the session's record when the agent returns:

- tokens: the first call's prompt (mask 0), then per call the template text of the new messages
  (mask 0) and the sampled tokens exactly (mask 1, the engine's logprobs); `weight_versions`
  lists each version that made tokens;
- `metadata["response_text"]` is the agent's return value (what the reward reads),
  `metadata["messages"]` the whole conversation (tool calls included), and counts: `calls`,
  `tool_calls`, `turns`, `trained_tokens`, `stop_reason` (the bound's explanation, or
  "agent_returned"), and the agent loop's fields, so `agent/*` metrics count these episodes
  too (`loop/episodes.py`): `episode_end` ("answer" when the agent returned, "max_turns" or
  "context" at a bound), `episode_tokens`, `sampled_tokens`, `env_info` (`tool_calls`);
- status COMPLETED; TRUNCATED when a bound ended the episode (max calls, max total tokens; the
  agent's answer, or "" if it raised, is still scored); ABORTED, with no tokens, when the engine
  aborted a call (the manager restarts it from its prompt; `metadata["restarts"]` counts that);
  FAILED (raised) when the agent raised otherwise, returned no string, or never called the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from rollouts.config import RolloutConfig
from rollouts.config.gateway import GATEWAY_GENERATE_FN, GatewayConfig
from rollouts.envs.threads import ThreadRunner
from rollouts.gateway.app import Gateway, open_gateway
from rollouts.gateway.session import Ending, Episode
from rollouts.plugins import load_function
from rollouts.rollout.generate import DONE_STATUSES
from rollouts.rollout.protocol import GenerateContext
from rollouts.rollout.trajectory import record_to_sample, without_tokens
from rollouts.types import Sample, Status


class AgentFn(Protocol):
    """`(base_url, prompt, metadata) -> str`, async or sync: the user's agent.

    `base_url` is an OpenAI-compatible endpoint for this sample alone (pass it to
    `openai.AsyncOpenAI(base_url=..., api_key=...)`; any api_key). `prompt` is the dataset's
    prompt (a list of chat messages, or text); `metadata` the dataset row's other fields (never
    the label). The return value is the final answer the reward reads.
    """

    def __call__(
        self, base_url: str, prompt: list[dict[str, Any]] | str, metadata: Mapping[str, Any]
    ) -> str: ...


def agent_generate(sample: Sample, ctx: GenerateContext) -> Sample:
    """The name `rollout.generate_fn` gives the gateway: the driver replaces it with the
    gateway's generate function (`open_agent_generate`, which needs a running gateway); a call
    of this name itself, outside train.py, says so."""
    raise RuntimeError(
        f"{GATEWAY_GENERATE_FN} runs behind the gateway that the driver starts for "
        "[rollout.gateway]; outside train.py, build it with rollouts.gateway.open_agent_generate"
    )


def _prompt_of(sample: Sample) -> list[dict[str, Any]] | str:
    return sample.prompt if isinstance(sample.prompt, str) else [dict(m) for m in sample.prompt]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentGenerate:
    """A generate function: `agent`'s episodes through `gateway` (see the module docstring)."""

    gateway: Gateway
    agent: Callable[..., Any]
    config: GatewayConfig

    async def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample:
        """One episode of the agent for `sample`."""
        if sample.status in DONE_STATUSES:
            return sample
        restarts = int(sample.metadata.get("restarts", 0)) + (sample.status is Status.ABORTED)
        runner = ctx.threads or ThreadRunner()
        answer: Any = None
        error: Exception | None = None
        with self.gateway.open(ctx, self.config.max_calls, self.config.call_timeout_s) as session:
            url = self.gateway.base_url(session)
            metadata = dict(sample.metadata)
            try:
                answer = await runner.call(
                    f"agent {self.config.agent or self.agent!r}",
                    1e9,  # the episode is bounded by rollout.generate_timeout_s around it
                    self.agent,
                    url,
                    _prompt_of(sample),
                    metadata,
                )
            except Exception as e:  # what it means depends on how the session ended
                error = e
        if session.fatal is not None:
            raise session.fatal
        return assemble(sample, session.episode, answer, error, restarts)


def _failed(episode: Episode, answer: Any, error: Exception | None) -> str:
    """Why the episode fails the sample, or "" when it makes one."""
    if episode.ending is Ending.FAILED:
        return episode.reason
    if episode.ending is Ending.TRUNCATED:
        return ""
    if error is not None:
        return f"the agent raised {type(error).__name__}: {error}"
    if not isinstance(answer, str):
        return f"the agent returned {type(answer).__name__}, not the answer as a str"
    if not episode.calls:
        return "the agent returned without calling the model: nothing to train"
    return ""


def assemble(
    sample: Sample, episode: Episode, answer: Any, error: Exception | None, restarts: int
) -> Sample:
    """The finished sample from an episode's record (see the module docstring)."""
    meta: dict[str, Any] = {**sample.metadata}
    if restarts:
        meta["restarts"] = restarts
    if episode.ending is Ending.DROPPED:  # restarted from its prompt by the manager
        return dataclasses.replace(without_tokens(sample), status=Status.ABORTED, metadata=meta)
    why = _failed(episode, answer, error)
    if why:
        raise RuntimeError(why) from error
    if not episode.calls:  # a bound ended the episode before its first answer
        raise RuntimeError(f"the episode ended before any answer: {episode.reason}")
    truncated = episode.ending is Ending.TRUNCATED
    meta.update(
        response_text=answer if isinstance(answer, str) else "",
        messages=episode.messages,
        calls=episode.calls,
        tool_calls=episode.tool_calls,
        turns=episode.calls,
        trained_tokens=sum(episode.mask),
        stop_reason=episode.reason if truncated else "agent_returned",
        episode_end=episode.bound if truncated else "answer",
        episode_tokens=len(episode.tokens),
        sampled_tokens=sum(episode.mask),
        env_info={"tool_calls": episode.tool_calls},
    )
    return record_to_sample(
        sample,
        episode,
        prompt_length=episode.prompt_length,
        status=Status.TRUNCATED if truncated else Status.COMPLETED,
        metadata=meta,
    )


@contextlib.asynccontextmanager
async def open_agent_generate(rollout: RolloutConfig) -> AsyncIterator[AgentGenerate | None]:
    """The gateway's generate function, its server up for the block, when `rollout.generate_fn`
    names the gateway; else None (and no server). The agent is loaded and checked first."""
    if rollout.generate_fn != GATEWAY_GENERATE_FN:
        yield None
        return
    agent = load_function(rollout.gateway.agent, AgentFn)
    async with open_gateway() as gateway:
        yield AgentGenerate(gateway=gateway, agent=agent, config=rollout.gateway)
