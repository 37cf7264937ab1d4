"""The multi-turn agent loop, token in, token out: a generate function like any other.

Each turn: render the generation header (mask 0), let the engine sample (tokens kept exactly as
sampled, mask 1, logprobs kept), append what the template adds after the turn (mask 0), step the
environment with the turn's text, append its observation (mask 0). Stops on: the environment
says done, `max_turns`, `max_total_tokens`, or an engine finish that is not STOP;
`metadata["episode_end"]` names which for the metrics: "answer", "budget" (the environment's
tool budget ran out), "max_turns", "context" (`max_total_tokens`), "turn_length" (a turn cut at
`max_new_tokens`), "aborted" or "failed". An environment with `tool_specs` (`DescribesTools`)
has its tools put before the model the way the chat template allows (`with_tools`: the
template's `tools` argument, else the system message). A prompt that
leaves no room under `max_total_tokens` fails the sample (as in single-turn). An ABORTED
multi-turn sample restarts from its prompt (an environment's state cannot be saved with it):
`metadata["restarts"]` counts that, and the manager reports it as restarted, not resumed.

The environment (its factory, `reset`, `step`) and the tools it calls are user code that may
block: they run in worker threads of `ctx.threads` under `ctx.env_timeout_s` per call, so a
blocking one fails only its own sample ("env.step timed out after 60 s").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rollouts.data.sft import encode, end_of_turn
from rollouts.envs.builtin import SingleTurnEnvironment
from rollouts.envs.protocol import ROLE_KEY, DescribesTools, Environment
from rollouts.envs.threads import ThreadRunner
from rollouts.envs.tool_format import with_tools
from rollouts.rollout.generate import DONE_STATUSES, fail_sample
from rollouts.rollout.protocol import GenerateContext
from rollouts.rollout.trajectory import ChatRenderer, record_to_sample
from rollouts.types import Sample, Status
from rollouts.wire.generation import Completion, FinishReason


@dataclasses.dataclass(kw_only=True, slots=True)
class _Trajectory:
    """Mutable state of one episode (local to one call of `generate_multi_turn`)."""

    renderer: ChatRenderer
    messages: list[dict[str, Any]]
    max_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)
    infos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    end: str = ""  # why a model turn ended the episode (see `episode_end`)

    def add_fixed(self, text: str) -> bool:
        """Template or environment text: encoded, never trained. False if it does not fit."""
        ids = encode(self.renderer.tokenizer, text) if text else []
        if self.tokens and len(self.tokens) + len(ids) > self.max_tokens:
            return False
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        return True

    def add_generated(self, completion: Completion, text: str) -> None:
        """The model's tokens exactly as sampled: trained, with the engine's logprobs."""
        self.tokens += completion.output_ids
        self.mask += [1] * len(completion.output_ids)
        self.logprobs += completion.logprobs
        self.renderer.generated(text)
        # a version answers for tokens; a turn aborted before its first token made none
        made = bool(completion.output_ids) or completion.finish_reason is not FinishReason.ABORT
        if made and (not self.versions or self.versions[-1] != completion.weight_version):
            self.versions.append(completion.weight_version)


def initial_messages(sample: Sample) -> list[dict[str, Any]]:
    """The prompt as chat messages (a text prompt becomes one user message)."""
    if isinstance(sample.prompt, str):
        return [{"role": "user", "content": sample.prompt}]
    return [dict(m) for m in sample.prompt]


def turn_text(tokenizer: Any, completion: Completion) -> tuple[str, str]:
    """(decoded turn as sampled, its message content: without the template's end-of-turn
    marker, which the template writes again after the content)."""
    text = tokenizer.decode(list(completion.output_ids), skip_special_tokens=False)
    eos = end_of_turn(tokenizer)
    content = text[: -len(eos)] if eos and text.endswith(eos) else text
    return text, content


def _turn_end(status: Status | None, cut_by_context: bool) -> str:
    """How a model turn ends the episode ("": it does not): a turn cut short ends it by
    "context" (what was left of max_total_tokens) or "turn_length" (max_new_tokens); an
    aborted or failed one by its status."""
    if status is None:
        return ""
    if status is Status.TRUNCATED:
        return "context" if cut_by_context else "turn_length"
    return status.value


def _status_of(reason: FinishReason) -> Status | None:
    return None if reason is FinishReason.STOP else reason.to_status()


async def _model_turn(
    traj: _Trajectory, ctx: GenerateContext, turn: int
) -> tuple[str, Status | None]:
    """One sampled assistant turn; returns (content, a final status or None to go on)."""
    left = ctx.max_total_tokens - len(traj.tokens)
    max_new = min(ctx.sampling.max_new_tokens, left)
    if max_new <= 0:
        traj.end = "context"
        return "", Status.TRUNCATED
    params = dataclasses.replace(ctx.sampling, max_new_tokens=max_new)
    completion = await ctx.engine.generate(tuple(traj.tokens), params, rid=f"{ctx.rid}-t{turn}")
    text, content = turn_text(ctx.tokenizer, completion)
    traj.add_generated(completion, text)
    traj.messages.append({"role": "assistant", "content": content})
    status = _status_of(completion.finish_reason)
    traj.end = _turn_end(status, cut_by_context=max_new < ctx.sampling.max_new_tokens)
    if status is None:  # a finished turn: the template's text after it (e.g. "\n"), untrained
        tail = traj.renderer.extend(traj.messages, False, f"turn {turn} (assistant)")
        status = None if traj.add_fixed(tail) else Status.TRUNCATED
        traj.end = "" if status is None else "context"
    return content, status


def _observe(traj: _Trajectory, observation: str, info: Mapping[str, Any], turn: int) -> bool:
    """Append the observation and the next generation header; False if they do not fit."""
    role = str(info.get(ROLE_KEY, "user"))
    traj.messages.append({"role": role, "content": observation})
    text = traj.renderer.extend(traj.messages, False, f"turn {turn} ({role})")
    text += traj.renderer.extend(traj.messages, True, f"turn {turn + 1} header")
    if traj.add_fixed(text):
        return True
    traj.messages.pop()  # the messages stay the exact trajectory of the tokens
    return False


async def step_env(
    env: Environment, action: str, runner: ThreadRunner | None = None, timeout_s: float = 60.0
) -> tuple[str, bool, Mapping[str, Any]]:
    """`env.step(action)` in a worker thread under `timeout_s` (awaited if async or if it returns
    an awaitable); an overrun raises `CallTimeout`."""
    return await (runner or ThreadRunner()).call("env.step", timeout_s, env.step, action)


async def generate_multi_turn(sample: Sample, ctx: GenerateContext) -> Sample:
    """The agent loop as a generate function (see the module docstring)."""
    if sample.status in DONE_STATUSES:
        return sample
    runner = ctx.threads or ThreadRunner()
    restarts = int(sample.metadata.get("restarts", 0)) + (sample.status is Status.ABORTED)
    factory = ctx.env_factory or SingleTurnEnvironment
    env: Environment = await runner.call("env factory", ctx.env_timeout_s, factory, sample)
    specs = env.tool_specs if isinstance(env, DescribesTools) else ()
    messages, template_args = with_tools(ctx.tokenizer, initial_messages(sample), specs)
    traj = _Trajectory(
        renderer=ChatRenderer(ctx.tokenizer, template_args),
        messages=messages,
        max_tokens=ctx.max_total_tokens,
    )
    first = await runner.call("env.reset", ctx.env_timeout_s, env.reset)
    if first:
        traj.messages.append({"role": "user", "content": first})
    traj.add_fixed(traj.renderer.extend(traj.messages, True, "the prompt"))
    prompt_len = len(traj.tokens)
    if prompt_len >= ctx.max_total_tokens:  # the single-turn rule: no room for one token
        return fail_sample(
            sample,
            f"prompt of {prompt_len} tokens leaves no room "
            f"under max_total_tokens={ctx.max_total_tokens}",
            "generate/no_room",
        )
    if restarts:
        sample = dataclasses.replace(sample, metadata={**sample.metadata, "restarts": restarts})
    status, stop = Status.COMPLETED, "max_turns"
    for turn in range(ctx.max_turns):
        content, final = await _model_turn(traj, ctx, turn)
        if final is not None:
            status, stop = final, final.value
            break
        observation, done, info = await step_env(env, content, runner, ctx.env_timeout_s)
        traj.infos.append(dict(info))
        if done:
            stop, traj.end = "env_done", "budget" if info.get("over_budget") else "answer"
            break
        if turn + 1 == ctx.max_turns:
            break
        if not _observe(traj, observation, info, turn):
            status, stop, traj.end = Status.TRUNCATED, "max_total_tokens", "context"
            break
    traj.end = traj.end or "max_turns"
    return _to_sample(sample, traj, prompt_len, status, stop)


def _to_sample(
    sample: Sample, traj: _Trajectory, prompt_len: int, status: Status, stop: str
) -> Sample:
    metadata: dict[str, Any] = {
        **sample.metadata,
        "messages": traj.messages,
        "turns": sum(m["role"] == "assistant" for m in traj.messages),
        "stop_reason": stop,
        "episode_end": traj.end,
        "episode_tokens": len(traj.tokens),
        "sampled_tokens": sum(traj.mask),
        "env_info": traj.infos[-1] if traj.infos else {},
        "env_infos": traj.infos,
    }
    return record_to_sample(
        sample, traj, prompt_length=prompt_len, status=status, metadata=metadata
    )
