"""Conversation environments (scripted, function and async users) and tool-env step signals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.data.sft import encode
from rollouts.envs import (
    ConversationEnvironment,
    Environment,
    ModelUser,
    UserReply,
    calculator_env,
    conversation_env,
    self_verify_env,
)
from rollouts.envs.conversation import user_view
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample
from rollouts.wire.generation import FinishReason, SamplingParams
from tests.rollout.fakes import ScriptedEngine

SAMPLE = Sample(index=0, group_index=0, prompt="Hi, I need help.", label="42")


def test_scripted_user_says_its_turns_then_ends() -> None:
    env = ConversationEnvironment(["What about Tuesday?", "Thanks!"], SAMPLE)
    assert isinstance(env, Environment)
    assert env.reset() == ""
    assert env.step("Sure, when?") == (
        "What about Tuesday?",
        False,
        {"role": "user", "user_turns": 1},
    )
    assert env.step("Tuesday works.")[:2] == ("Thanks!", False)
    obs, done, info = env.step("Bye.")
    assert (obs, done, info["ended_by"], info["user_turns"]) == ("", True, "user", 2)
    assert [m["role"] for m in env.history] == ["user", *["assistant", "user"] * 2, "assistant"]
    env.reset()  # a fresh episode starts from the prompt again
    assert env.step("again")[0] == "What about Tuesday?"


def test_function_user_signals_and_bound() -> None:
    def user(history):
        last = history[-1]["content"]
        if "42" in last:
            return UserReply(message=None, info={"success": True, "step_reward": 1.0})
        return UserReply(message="No, try again.", info={"step_reward": -0.5})

    env = ConversationEnvironment(user, SAMPLE, max_user_turns=2)
    env.reset()
    assert env.step("41")[2]["step_reward"] == -0.5
    _, done, info = env.step("It is 42.")
    assert (done, info["success"], info["step_reward"]) == (True, True, 1.0)

    env.reset()
    env.step("1")
    env.step("2")
    _, done, info = env.step("3")  # two user turns used: the conversation is over
    assert (done, info["ended_by"]) == (True, "max_user_turns")
    with pytest.raises(TypeError, match="expected str"):
        ConversationEnvironment(lambda h: 7).step("x")


def test_user_view_swaps_roles() -> None:
    history = [
        {"role": "system", "content": "assistant's system"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert user_view(history, "be a user") == [
        {"role": "system", "content": "be a user"},
        {"role": "assistant", "content": "q"},
        {"role": "user", "content": "a"},
    ]


def test_tool_envs_report_step_signals() -> None:
    env = calculator_env(SAMPLE, budget=1.0)
    env.reset()
    ok = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert env.step(ok)[2]["invalid_action"] is False
    _, done, info = env.step("<calculator><expression>1/0</expression></calculator>")
    assert (done, info["invalid_action"]) == (True, True)  # over budget
    _, _, info = env.step("<answer>42</answer>")
    assert "success" not in info  # no expected answer: success unknown
    verify = self_verify_env(SAMPLE)
    verify.reset()
    assert verify.step("<tool_call>{oops}</tool_call>")[2]["invalid_action"] is True
    assert verify.step("<answer>42</answer>")[2]["success"] is True
    verify.reset()
    assert verify.step("<answer>41</answer>")[2]["success"] is False


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_async_user_through_the_agent_loop(tok) -> None:
    """An async user's awaitable step is awaited; its turns are in the tokens with mask 0."""
    seen: list[int] = []

    async def user(history):
        seen.append(len(history))
        return None if len(seen) == 3 else f"more {len(seen)}"

    replies = [[*encode(tok, f"answer {k}"), tok.eos_token_id] for k in range(3)]
    ctx = GenerateContext(
        engine=ScriptedEngine(replies, tok.eos_token_id),
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=64),
        rid="r",
        max_total_tokens=1024,
        max_turns=5,
        env_factory=conversation_env(user),
    )
    out = await generate_multi_turn(SAMPLE, ctx)
    assert seen == [2, 4, 6]  # the prompt, then one assistant + one user message per step
    assert out.metadata["stop_reason"] == "env_done"
    roles = [(m["role"], m["content"]) for m in out.metadata["messages"]]
    assert roles == [
        ("user", "Hi, I need help."),
        ("assistant", "answer 0"),
        ("user", "more 1"),
        ("assistant", "answer 1"),
        ("user", "more 2"),
        ("assistant", "answer 2"),
    ]
    trained = tok.decode([t for t, m in zip(out.tokens, out.loss_mask, strict=True) if m])
    untrained = tok.decode([t for t, m in zip(out.tokens, out.loss_mask, strict=True) if not m])
    assert trained == "".join(f"answer {k}{tok.eos_token}" for k in range(3))
    assert "more 1" in untrained and "more 2" in untrained


class AbortingEngine(ScriptedEngine):
    """Every request comes back aborted (as a paused or surplus-aborting server answers)."""

    async def generate(self, input_ids, sampling, rid=None):
        out = await super().generate(input_ids, sampling, rid)
        return dataclasses.replace(out, finish_reason=FinishReason.ABORT)


async def test_model_user_end_marker_and_abort(tok) -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    replies = [encode(tok, " thanks "), encode(tok, "bye [END]")]
    user = ModelUser(engine=ScriptedEngine(replies, tok.eos_token_id), tokenizer=tok, persona="P")
    assert await user(history) == "thanks"
    assert await user(history) is None
    sent = tok.decode(list(user.engine.requests[0][0]))
    assert sent.startswith("<|im_start|>system\nP<|im_end|>\n<|im_start|>assistant\nhi")
    aborting = ModelUser(engine=AbortingEngine([[5]], tok.eos_token_id), tokenizer=tok)
    with pytest.raises(RuntimeError, match="ended with abort"):
        await aborting(history)
