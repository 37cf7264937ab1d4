"""The end-of-turn marker comes from the chat template, not from `eos_token`.

A base-model tokenizer like Qwen2.5's: eos `<|endoftext|>`, but ChatML turns end with
`<|im_end|>`. Built locally from the tiny-model kit and loaded back from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.data.sft import encode, end_of_turn, tokenize_conversation
from rollouts.envs import conversation_env
from rollouts.models.tiny import IM_END, PAD_TOKEN, train_tokenizer
from rollouts.rollout.agent import generate_multi_turn, turn_text
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status
from rollouts.wire.generation import Completion, FinishReason, SamplingParams
from tests.rollout.fakes import ScriptedEngine


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory: pytest.TempPathFactory):
    tok = train_tokenizer([], "char")
    tok.eos_token = PAD_TOKEN  # like Qwen2.5 base: eos <|endoftext|>, turns end with <|im_end|>
    out = tmp_path_factory.mktemp("base-tok")
    tok.save_pretrained(out)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.eos_token == "<|endoftext|>"
    return loaded


def test_end_of_turn_is_read_from_the_template(base_tok, tiny_model_dir: Path) -> None:
    assert end_of_turn(base_tok) == IM_END
    assert end_of_turn(AutoTokenizer.from_pretrained(tiny_model_dir)) == IM_END


def test_sft_trains_through_the_end_of_turn_not_the_template_newline(base_tok) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    tokens, mask = tokenize_conversation(base_tok, messages)
    trained = base_tok.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    assert trained == "ok<|im_end|>"
    assert base_tok.decode(tokens[-1:]) == "\n" and mask[-1] == 0


async def test_agent_turn_content_and_tokens_have_one_end_of_turn(base_tok) -> None:
    im_end = base_tok.convert_tokens_to_ids(IM_END)
    reply = [*encode(base_tok, "hello"), im_end]
    completion = Completion(
        output_ids=tuple(reply),
        logprobs=(-0.1,) * len(reply),
        finish_reason=FinishReason.STOP,
        weight_version="0",
        prompt_tokens=3,
        completion_tokens=len(reply),
    )
    assert turn_text(base_tok, completion) == ("hello<|im_end|>", "hello")
    engine = ScriptedEngine([reply, reply], eos_id=im_end)
    ctx = GenerateContext(
        engine=engine,
        tokenizer=base_tok,
        sampling=SamplingParams(max_new_tokens=16),
        rid="eot",
        max_turns=2,
        env_factory=conversation_env(["again"], max_user_turns=1),
    )
    out = await generate_multi_turn(Sample(index=0, group_index=0, prompt="hi"), ctx)
    assert out.status is Status.COMPLETED
    text = base_tok.decode(list(out.tokens))
    assert "<|im_end|><|im_end|>" not in text
    assert text.count("hello<|im_end|>\n") == 2
    assert [m["content"] for m in out.metadata["messages"] if m["role"] == "assistant"] == [
        "hello",
        "hello",
    ]
