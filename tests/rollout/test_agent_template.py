"""The agent loop under SmolLM2's real tokenizer and chat template, against a real engine.

A tiny Llama with SmolLM2-135M-Instruct's tokenizer (the real one: BPE, ChatML template, a
`tool` role) is served by the built-in engine; episodes run through the agent loop with the
shop's tools in the system message and tool results as `tool` messages. The trained tokens must
be exactly the tokens the engine sampled (token in, token out across turns), and no template,
system, tool-result or observation token may carry loss. A template that rewrites earlier turns
(Qwen3's, which drops the reasoning block of assistant turns once a user message follows) fails
the episode that triggers it, with a message that says where, and only that episode.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollouts.config import SamplingConfig
from rollouts.data.sft import render
from rollouts.engine.launch import EngineProcess, engine_server_sync
from rollouts.envs.shop import shop_tool_specs
from rollouts.inference.sglang import SGLangEngine
from rollouts.models.tiny import TinyModelSpec, build_tiny_model
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status
from rollouts.wire.generation import Completion, SamplingParams
from tests.rollout import manager_cases as cases

# Qwen3's rule, on ChatML: assistant turns after the last user message carry the (empty)
# reasoning block the generation prompt opened; earlier ones are written without it
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir: Path) -> Any:
    """SmolLM2-135M-Instruct's own tokenizer and chat template, loaded once (seconds a load)."""
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def smol_tiny_dir(smol_tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer."""
    out = tmp_path_factory.mktemp("smol-tiny")
    tokenizer = smol_tok
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    build_tiny_model(spec, tokenizer).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def smol_server(smol_tiny_dir: Path) -> Iterator[EngineProcess]:
    with engine_server_sync(smol_tiny_dir, max_batch=16) as proc:
        yield proc


class RecordingEngine:
    """The real client, with each generate call's input and completion recorded by request id."""

    def __init__(self, inner: SGLangEngine) -> None:
        self.inner = inner
        self.calls: dict[str, list[tuple[tuple[int, ...], Completion]]] = {}

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        out = await self.inner.generate(input_ids, sampling, rid)
        sample_rid = str(rid).rsplit("-t", 1)[0]
        self.calls.setdefault(sample_rid, []).append((tuple(input_ids), out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def engine(smol_server: EngineProcess) -> AsyncIterator[RecordingEngine]:
    client = SGLangEngine(smol_server.url)
    try:
        yield RecordingEngine(client)
    finally:
        await client.aclose()


class ToolResults:
    """Answers every turn with a tool result (role from `role`) until `turns` turns are done."""

    def __init__(self, sample: Sample, turns: int = 3, role: str = "tool") -> None:
        self.turns, self.role, self.n = turns, role, 0
        self.tool_specs = shop_tool_specs()

    def reset(self) -> str:
        return ""

    def step(self, action: str) -> tuple[str, bool, Mapping[str, Any]]:
        self.n += 1
        return f'{{"price": {10 + self.n}, "stock": 7}}', self.n >= self.turns, {"role": self.role}


def _stops(tok: Any) -> tuple[int, ...]:
    """A quarter of the vocabulary, <|im_end|> included: turns of a few tokens that end in STOP."""
    return (tok.eos_token_id, *range(0, len(tok), 4))


def sampled_positions(s: Sample, calls: Sequence[tuple[tuple[int, ...], Completion]]) -> set[int]:
    """Where the engine's tokens sit in the sample, checked token in and token out."""
    positions: set[int] = set()
    for turn, (given, out) in enumerate(calls):
        start = len(given)
        assert s.tokens[:start] == given, f"turn {turn}: the engine was given other tokens"
        assert s.tokens[start : start + len(out.output_ids)] == out.output_ids, f"turn {turn}"
        logprobs = s.rollout_logprobs[start - s.prompt_length :][: len(out.output_ids)]
        assert logprobs == out.logprobs, f"turn {turn}: logprobs not the engine's"
        positions |= set(range(start, start + len(out.output_ids)))
    return positions


def check_trained_exactly_sampled(tok: Any, s: Sample, positions: set[int]) -> None:
    """Loss on every sampled token and on nothing else, token by token."""
    for i, (token, mask) in enumerate(zip(s.tokens, s.loss_mask, strict=True)):
        want = int(i in positions)
        assert mask == want, (
            f"token {i} ({tok.decode([token])!r}, after {tok.decode(list(s.tokens[:i]))[-60:]!r})"
            f" has loss mask {mask}: it was {'' if want else 'not '}sampled by the engine"
        )


async def test_trained_tokens_are_the_sampled_ones_under_smollm2s_template(
    engine: RecordingEngine, smol_tok: Any
) -> None:
    tok = smol_tok
    # 9 turns that must each end in a stop token: with a quarter of the vocabulary stopping a
    # turn, one still running after 8 tokens is ~10% a turn (0.75 ** 8) and the test rode on
    # its seeds' draws; with 24 tokens allowed, ~0.1%
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=_stops(tok), seed=1)
    done: list[Sample] = []
    for i in range(3):
        sample = Sample(index=i, group_index=i, prompt=f"What do {i + 3} units of lamp cost?")
        ctx = GenerateContext(
            engine=engine,
            tokenizer=tok,
            sampling=dataclasses.replace(sampling, seed=i),
            rid=f"s{i}",
            max_total_tokens=600,
            max_turns=4,
            env_factory=ToolResults,
        )
        done.append(await generate_multi_turn(sample, ctx))
    for s in done:
        assert s.status is Status.COMPLETED and s.metadata["turns"] == 3, s.metadata
        assert s.metadata["episode_end"] == "answer"
        check_trained_exactly_sampled(tok, s, sampled_positions(s, engine.calls[f"s{s.index}"]))
        # the untrained tokens are the real template's text: system with the tools, tool results
        messages = s.metadata["messages"]
        assert [m["role"] for m in messages] == [
            "system",
            "user",
            *["assistant", "tool"] * 2,
            "assistant",
        ]
        assert tok.decode(list(s.tokens)) == render(tok, messages, False)
        assert messages[0]["content"].startswith("You can use these tools")
        assert '"name": "lookup"' in messages[0]["content"]


async def test_a_template_that_rewrites_earlier_turns_fails_only_its_episode(
    engine: RecordingEngine, smol_tok: Any
) -> None:
    """Qwen3-like: tool results keep it append-only; a user message after a turn rewrites it."""
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = QWEN3_LIKE

    def env(sample: Sample) -> ToolResults:  # group 0: user observations, group 1: tool results
        return ToolResults(sample, turns=2, role="user" if sample.group_index == 0 else "tool")

    config = cases.make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        max_turns=3,
        max_total_tokens=600,
    )
    # half the vocabulary stops a turn: this batch runs concurrently, so its floats (and tokens)
    # depend on the rows beside it; a turn still running after 8 tokens is then ~0.4%, not ~10%
    halves = [tok.eos_token_id, *range(0, len(tok), 2)]
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_token_ids=halves)
    config = dataclasses.replace(config, sampling=sampling)
    manager = AsyncRolloutManager(
        cases.make_buffer(), config, engine, tokenizer=tok, env_factory=env
    )
    batch = await manager.generate_batch(lambda s: float(s.index % 2))
    meta = batch.metadata
    assert meta["failed_samples"] == 2, meta
    assert meta["drop_reasons"] == {"failed": 1}, meta
    assert len(meta["errors"]) == 2, meta["errors"]
    for error in meta["errors"]:  # says where the render changed: the reasoning block it dropped
        assert "TemplateError: chat template is not append-only at turn 0 (user)" in error, error
        assert "<think>" in error, error
    # the run goes on: the batch is filled with groups whose episodes got tool results
    assert [g[0].group_index for g in batch.groups] == [1, 2], meta
    for s in batch.samples:  # not failed (a random model's turn may run out of its 8 tokens)
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
        assert s.metadata["episode_end"] in ("answer", "turn_length"), s.metadata
        assert "error" not in s.metadata, s.metadata
