"""Multi-turn agent loop: token-in-token-out loss masks on a known conversation."""

from __future__ import annotations

import copy

import pytest

from rollouts.data.sft import TemplateError, encode
from rollouts.envs import TextGameEnvironment, calculator_env
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.protocol import GenerateContext
from rollouts.rollout.trajectory import trajectory_to_sample
from rollouts.types import Sample, Status
from rollouts.wire.generation import SamplingParams
from tests.rollout.fakes import ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>'


def spans(tok, tokens, mask) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or mask[i] != mask[start]:
            out.append((tok.decode(list(tokens[start:i])), mask[start]))
            start = i
    return out


def ctx_for(tok, engine, env_factory, max_turns=4, max_total_tokens=1024, max_new=256):
    return GenerateContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=max_new),
        rid="r",
        max_total_tokens=max_total_tokens,
        max_turns=max_turns,
        env_factory=env_factory,
    )


def reply(tok, text: str) -> list[int]:
    return [*encode(tok, text), tok.eos_token_id]


async def test_tool_conversation_masks_token_by_token(tok) -> None:
    engine = ScriptedEngine([reply(tok, CALL), reply(tok, "<answer>14</answer>")], tok.eos_token_id)
    sample = Sample(index=0, group_index=0, prompt="What is 2+3*4?", label="14")
    out = await generate_multi_turn(sample, ctx_for(tok, engine, calculator_env))
    assert out.status is Status.COMPLETED
    assert spans(tok, out.tokens, out.loss_mask) == [
        ("<|im_start|>user\nWhat is 2+3*4?<|im_end|>\n<|im_start|>assistant\n", 0),
        (CALL + "<|im_end|>", 1),
        ("\n<|im_start|>tool\n14<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<answer>14</answer><|im_end|>", 1),
        ("\n", 0),
    ]
    # the model's tokens are kept exactly as sampled, with their logprobs; the rest has 0
    assert [t for t, m in zip(out.tokens, out.loss_mask, strict=True) if m] == (
        reply(tok, CALL) + reply(tok, "<answer>14</answer>")
    )
    response_mask = out.loss_mask[out.prompt_length :]
    assert out.rollout_logprobs == tuple(-0.5 if m else 0.0 for m in response_mask)
    # the second request continued from exactly the tokens held so far
    second_input = engine.requests[1][0]
    assert second_input == out.tokens[: len(second_input)]
    # the same conversation through trajectory_to_sample gives the same tokens and masks
    again = trajectory_to_sample(tok, out.metadata["messages"])
    assert again.tokens == out.tokens
    assert again.loss_mask == out.loss_mask
    assert again.response_length == out.response_length
    assert out.metadata["env_info"]["final_answer"] == "14"
    assert out.metadata["turns"] == 2


async def test_tool_budget_ends_the_episode(tok) -> None:
    call = CALL.replace("2+3*4", "1+1")
    engine = ScriptedEngine([reply(tok, call)] * 5, tok.eos_token_id)
    sample = Sample(index=0, group_index=0, prompt="go")

    def factory(s):
        return calculator_env(s, budget=2.0)

    out = await generate_multi_turn(sample, ctx_for(tok, engine, factory, max_turns=5))
    info = out.metadata["env_info"]
    assert info["over_budget"] is True
    assert info["tool_cost"] == 2.0  # two calls ran, the third was refused
    assert out.metadata["stop_reason"] == "env_done"
    assert out.metadata["episode_end"] == "budget"  # the metrics' name for how it ended
    assert len(engine.requests) == 3


async def test_max_turns_and_max_total_tokens_bound_the_loop(tok) -> None:
    engine = ScriptedEngine([reply(tok, "look")] * 10, tok.eos_token_id)
    sample = Sample(index=0, group_index=0, prompt="play")
    out = await generate_multi_turn(sample, ctx_for(tok, engine, TextGameEnvironment, max_turns=3))
    assert out.metadata["turns"] == 3
    assert out.metadata["stop_reason"] == "max_turns"
    assert out.metadata["episode_end"] == "max_turns"
    assert out.metadata["messages"][-1]["role"] == "assistant"

    engine = ScriptedEngine([reply(tok, "look")] * 10, tok.eos_token_id)
    out = await generate_multi_turn(
        sample, ctx_for(tok, engine, TextGameEnvironment, max_turns=10, max_total_tokens=200)
    )
    assert out.status is Status.TRUNCATED
    assert out.metadata["episode_end"] == "context"
    assert len(out.tokens) <= 200


async def test_template_that_rewrites_earlier_turns_fails_loudly(tok) -> None:
    bad = copy.deepcopy(tok)
    bad.chat_template = (
        "{{ 'turns=' ~ (messages|length) ~ '\n' }}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    engine = ScriptedEngine([reply(tok, "hi")], tok.eos_token_id)
    sample = Sample(index=0, group_index=0, prompt="q")
    with pytest.raises(TemplateError, match="append-only"):
        await generate_multi_turn(sample, ctx_for(bad, engine, TextGameEnvironment))


def test_trajectory_to_sample_inlines_tool_calls(tok) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "calculator", "arguments": '{"expression": "1"}'}}
            ],
        },
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "1"},
    ]
    sample = trajectory_to_sample(tok, messages, index=3, label="1")
    trained = tok.decode([t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    assert trained == f"{call}<|im_end|>1<|im_end|>"
    assert (
        tok.decode(list(sample.prompt_tokens))
        == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.index == 3


def test_trajectory_without_a_prompt_is_an_error(tok) -> None:
    with pytest.raises(ValueError, match="prompt message"):
        trajectory_to_sample(tok, [{"role": "assistant", "content": "x"}])
