"""One chat completion of a session: check it, render what it adds, sample, record, answer.

Nothing is recorded unless the engine's answer is: a refused call (400) leaves the episode as it
was, so the agent may send a corrected one. An engine abort (finish ABORT: the manager dropped
the sample as surplus, or a weight sync in abort mode) ends the session DROPPED: the call and
every later one get a 410 saying so, and the sample goes back ABORTED (the manager restarts it
from its prompt). A bound (`rollout.gateway.max_calls`, `rollout.max_total_tokens`) ends it
TRUNCATED; a timed-out call or lost engines end it FAILED.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import trio

from rollouts.data.sft import end_of_turn
from rollouts.gateway.session import (
    Ending,
    Episode,
    Turn,
    commit,
    encode_text,
    new_messages,
    prompt_text,
)
from rollouts.gateway.wire import (
    ChatRequest,
    GatewayError,
    assistant_message,
    completion_body,
    finish_reason,
    parse_request,
)
from rollouts.inference.http import EngineRequestError, EngineUnavailable
from rollouts.rollout.protocol import GenerateContext
from rollouts.wire.generation import Completion, FinishReason, SamplingParams

SEED_MODULUS = 2**63  # request seeds stay in [0, 2**63) (rollout/seeds.py)


@dataclasses.dataclass(kw_only=True, slots=True)
class Session:
    """A sample's session: its generate context, bounds, episode record, and call state."""

    token: str
    ctx: GenerateContext
    max_calls: int
    call_timeout_s: float
    episode: Episode = dataclasses.field(default_factory=Episode)
    busy: bool = False  # a call is in flight (one at a time: an episode is one sequence)
    fatal: BaseException | None = None  # an engine error the run must see (no engine left)

    def __post_init__(self) -> None:
        assert self.max_calls >= 1, f"{self.max_calls=}"
        assert self.call_timeout_s > 0, f"{self.call_timeout_s=}"


def _ended(episode: Episode) -> GatewayError:
    assert episode.ending is not None, "the session has not ended"
    status = 410 if episode.ending is Ending.DROPPED else 400
    return GatewayError(status, episode.reason, code=f"session_{episode.ending.value}")


def _sampling(session: Session, request: ChatRequest, room: int) -> SamplingParams:
    base = session.ctx.sampling
    max_new = min(base.max_new_tokens, room, request.max_tokens or base.max_new_tokens)
    seed = None if base.seed is None else (base.seed + session.episode.calls) % SEED_MODULUS
    stop = (*base.stop, *request.stop)
    return dataclasses.replace(base, max_new_tokens=max_new, seed=seed, stop=stop)


def _check_bounds(session: Session, prompt_ids: int) -> int:
    """The tokens left for the answer; ends the episode TRUNCATED at a bound."""
    ep, ctx = session.episode, session.ctx
    if ep.calls >= session.max_calls:
        reason = (
            f"this episode made its {session.max_calls} calls (rollout.gateway.max_calls); "
            "return the answer"
        )
        ep.end(Ending.TRUNCATED, reason, bound="max_turns")
        raise GatewayError(400, reason, code="max_calls")
    room = ctx.max_total_tokens - len(ep.tokens) - prompt_ids
    if room <= 0:
        reason = (
            f"the episode holds {len(ep.tokens) + prompt_ids} tokens with this call's messages, "
            f"rollout.max_total_tokens = {ctx.max_total_tokens}; no room for an answer"
        )
        ep.end(Ending.TRUNCATED, reason, bound="context")
        raise GatewayError(400, reason, param="messages", code="context_length_exceeded")
    return room


async def _sample(session: Session, input_ids: list[int], params: SamplingParams) -> Completion:
    """The engine's completion under the call timeout; ends the session on a failure."""
    ep, ctx = session.episode, session.ctx
    rid = f"{ctx.rid}-c{ep.calls}"
    try:
        with trio.fail_after(session.call_timeout_s):
            completion = await ctx.engine.generate(tuple(input_ids), params, rid=rid)
    except trio.TooSlowError:
        reason = f"call {ep.calls} timed out after {session.call_timeout_s:g} s"
        ep.end(Ending.FAILED, reason + " (rollout.gateway.call_timeout_s)")
        raise GatewayError(504, ep.reason) from None
    except EngineRequestError as e:  # the engine refused this prompt; nothing recorded
        raise GatewayError(400, f"the engine refused the call: {e}") from e
    except EngineUnavailable as e:
        session.fatal = e
        ep.end(Ending.FAILED, f"no engine could serve the call: {e}")
        raise GatewayError(503, ep.reason) from e
    if completion.finish_reason is FinishReason.ABORT:
        ep.end(
            Ending.DROPPED,
            "sample dropped: the engine aborted this call (the batch had enough samples, or a "
            "weight sync aborted it); the rollout restarts this sample later, so stop here",
        )
        raise _ended(ep)
    if completion.finish_reason is FinishReason.ERROR:
        ep.end(Ending.FAILED, f"the engine failed the call: {completion.text[:200]!r}")
        raise GatewayError(500, ep.reason)
    return completion


def _turn(tokenizer: Any, completion: Completion, request: ChatRequest) -> tuple[Turn, str]:
    """The sampled turn, and its content as the template renders it (no end-of-turn marker)."""
    ids = list(completion.output_ids)
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    eos = end_of_turn(tokenizer)
    raw_content = raw[: -len(eos)] if eos and raw.endswith(eos) else raw
    visible = tokenizer.decode(ids, skip_special_tokens=True)
    split = bool(request.tools) and request.tool_choice == "auto"
    return Turn(completion=completion, raw_text=raw, message=assistant_message(visible, split)), (
        raw_content
    )


async def chat(session: Session, body: Any) -> dict[str, Any]:
    """Serve one `/v1/chat/completions` body for `session` (see the module docstring)."""
    ep, ctx = session.episode, session.ctx
    request = parse_request(body, ctx.sampling)
    if ep.ending is not None:
        raise _ended(ep)
    if session.busy:
        raise GatewayError(
            400, "a call of this episode is still in flight: one call at a time per base_url"
        )
    session.busy = True
    try:
        added = new_messages(ep, request)
        text = prompt_text(ctx.tokenizer, ep, added, request.tools)
        ids = encode_text(ctx.tokenizer, text)  # on the loop: a fast tokenizer is not thread-safe
        room = _check_bounds(session, len(ids))
        completion = await _sample(session, ep.tokens + ids, _sampling(session, request, room))
        turn, raw_content = _turn(ctx.tokenizer, completion, request)
        commit(ep, request.tools, added, text, ids, turn, raw_content)
    finally:
        session.busy = False
    pairs = None
    if request.logprobs:
        pieces = [ctx.tokenizer.decode([t]) for t in completion.output_ids]
        pairs = list(zip(pieces, completion.logprobs, strict=True))
    return completion_body(
        model=request.model,
        message=turn.message,
        finish=finish_reason(turn.message, completion.finish_reason),
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        token_logprobs=pairs,
    )
