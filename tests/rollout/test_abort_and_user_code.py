"""Issue 17 on the real built-in server: aborts scoped to one batch, honest resume counts, rounds
as waves, staleness checked before resuming, and blocking or async user code (tools, env steps,
generate functions) that fails only its own sample.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import pytest
import trio

from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.envs.threads import ThreadRunner
from rollouts.envs.tools import Tool, ToolCall, run_tool_call
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.generate import generate_single_turn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import PromptItem, Sample, Status
from rollouts.wire.generation import FinishReason, SamplingParams
from tests.rollout.manager_cases import alternating_reward, make_buffer
from tests.rollout.manager_cases import make_config as base_config


def make_config(stop_every: int = 0, **kw: Any) -> Any:
    """The manager cases' config; `stop_every` makes every k-th token id a stop token (turns of
    varied length, so a batch's first groups finish while the others are still running; 1 =
    one-token turns that always end with STOP, so the environment is stepped)."""
    config = base_config(**kw)
    if not stop_every:
        return config
    ids = list(range(0, 300, stop_every))
    return dataclasses.replace(
        config, sampling=dataclasses.replace(config.sampling, stop_token_ids=ids)
    )


@pytest.mark.parametrize("client", [SGLangEngine, VLLMEngine])
async def test_abort_by_prefix_leaves_other_requests_alone(server, client) -> None:
    engine = client(server.url)
    observer = SGLangEngine(server.url)  # the server's own count (vLLM's load is the client's)
    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    out: dict[str, Any] = {}

    async def gen(rid: str) -> None:
        out[rid] = await engine.generate([5, 6, 7], long, rid=rid)

    try:
        async with trio.open_nursery() as nursery:
            for rid in ("batchA-g0-s0", "batchA-g1-s0", "other-0"):
                nursery.start_soon(gen, rid)
            while (await observer.load()).running < 3:  # all three on the server, running
                await trio.sleep(0.002)
            await engine.abort("batchA-")
    finally:
        await engine.aclose()
        await observer.aclose()
    assert out["batchA-g0-s0"].finish_reason is FinishReason.ABORT
    assert out["batchA-g1-s0"].finish_reason is FinishReason.ABORT
    assert out["other-0"].finish_reason is FinishReason.LENGTH
    assert out["other-0"].completion_tokens == 200


async def test_eval_beside_an_over_sampling_batch_is_not_aborted(engine, tok) -> None:
    """The batch aborts its surplus while an evaluation runs on the same server: only the
    batch's requests end. On a loaded box every surplus group can finish before the batch is
    full (nothing to abort, the stop 38 CI failure), so it tries again (5 batches at most)
    until the batch did abort some of its own requests."""
    items = [PromptItem(index=i, prompt=f"e{i}:") for i in range(8)]
    spec = EvalSpec(max_new_tokens=96)
    config = make_config(
        stop_every=16,
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=6.0,
        max_new_tokens=64,
    )
    manager = AsyncRolloutManager(
        make_buffer(), config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: 0)
    )
    for _ in range(5):
        results: dict[str, Any] = {}

        async def run_eval(results: dict[str, Any] = results) -> None:
            results["eval"] = await evaluate(engine, tok, items, lambda s: 1.0, spec)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_eval)
            while (await engine.load()).total < len(items):
                await trio.sleep(0.01)
            batch = await manager.generate_batch()
        evaluated = results["eval"].samples
        assert all(s.status is not Status.ABORTED for s in evaluated)
        assert all("resumed_at" not in s.metadata for s in evaluated)  # never hit by that abort
        assert results["eval"].failed == 0
        if batch.metadata.get("aborted_samples", 0) > 0:
            break
    assert batch.metadata.get("aborted_samples", 0) > 0  # the batch did abort its own surplus


async def test_eval_resumes_an_aborted_rollout_instead_of_scoring_it(engine, tok) -> None:
    items = [PromptItem(index=i, prompt=f"x{i}:") for i in range(4)]
    greedy = await evaluate(engine, tok, items, lambda s: 1.0, EvalSpec(max_new_tokens=48))
    results = {}

    async def run_eval() -> None:
        results["eval"] = await evaluate(
            engine, tok, items, lambda s: 1.0, EvalSpec(max_new_tokens=48)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_eval)
        while (await engine.load()).total < len(items):
            await trio.sleep(0.005)
        await engine.abort_all()  # e.g. a pause in abort mode
    evaluated = results["eval"].samples
    assert any("resumed_at" in s.metadata for s in evaluated)
    assert all(s.status is not Status.ABORTED for s in evaluated)
    assert [s.response_length for s in evaluated] == [s.response_length for s in greedy.samples]


async def test_multi_turn_restarts_are_counted_as_restarts(engine, tok) -> None:
    config = make_config(
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=4.0,
        max_turns=2,
        max_new_tokens=64,
        stop_every=16,
    )
    buffer = make_buffer()
    manager = AsyncRolloutManager(
        buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: 0)
    )
    for _ in range(4):  # a batch whose surplus all finished in time aborts nothing: try again
        first = await manager.generate_batch()
        if first.metadata.get("aborted_samples", 0):
            break
    aborted = sum(s.status is Status.ABORTED for g in buffer._partial for s in g)
    assert first.metadata["aborted_samples"] == aborted > 0
    second = await manager.generate_batch()
    # the agent loop cannot resume a turn: every aborted sample started over, none "resumed"
    assert second.metadata.get("resumed_samples", 0) == 0
    assert second.metadata["restarted_samples"] >= 1
    restarted = [s for g in second.groups for s in g if s.metadata.get("restarts")]
    assert all(s.metadata["turns"] >= 1 for s in restarted)


async def test_partial_rollouts_off_requeues_and_counts_restarted_groups(engine, tok) -> None:
    config = make_config(
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=4.0,
        partial_rollouts=False,
        max_new_tokens=128,
        stop_every=48,  # long, varied turns: the surplus is still running when the batch is full
    )
    buffer = make_buffer()
    manager = AsyncRolloutManager(
        buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: 0)
    )
    restarted = 0
    for _ in range(4):  # a batch whose surplus all finished in time aborts nothing: try again
        batch = await manager.generate_batch()
        restarted = batch.metadata.get("restarted_groups", 0)
        pending = [g for g in buffer._partial if all(s.status is Status.PENDING for s in g)]
        assert len(pending) == len(buffer._partial) == batch.metadata["partial_groups_saved"]
        assert all(not s.tokens for g in pending for s in g)
        dropped = batch.metadata["dropped_groups"]
        assert dropped == batch.metadata["drop_reasons"].get("surplus", 0)
        if restarted:
            break
    assert restarted >= 1  # aborted groups go back to their prompts, counted as such


async def test_rounds_are_waves_so_top_ups_fill_the_batch(engine, tok) -> None:
    # factor 1.0 and a filter keeping half the groups: top-ups share the 4-wave budget
    config = make_config(
        batch_size=4,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        filters=["check_reward_nonzero_std"],
    )
    manager = AsyncRolloutManager(make_buffer(64), config, engine, tokenizer=tok)
    for _ in range(3):
        batch = await manager.generate_batch(alternating_reward(lambda g: g % 2 == 0))
        assert len(batch.groups) == 4
        assert batch.metadata["short_batch"] is False
        assert batch.metadata["rounds"] <= 4


async def test_stale_partial_groups_are_dropped_before_generation(engine, tok) -> None:
    config = make_config(
        stop_every=16,
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=4.0,
        max_new_tokens=64,
    )
    buffer = make_buffer()
    manager = AsyncRolloutManager(
        buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: 0)
    )
    await manager.generate_batch(policy_version="0", max_staleness=0)
    saved = buffer.num_partial_groups
    assert saved > 0  # generated by version "default" (= 0)
    batch = await manager.generate_batch(policy_version="1", max_staleness=0)
    assert batch.metadata["stale_partial_groups"] == saved
    assert batch.metadata.get("resumed_samples", 0) == 0
    for s in (s for g in batch.groups for s in g):
        assert "resumed_at" not in s.metadata


class _ToolEnv:
    """Every step calls one tool, whatever the model said; group 0 gets the bad tool."""

    def __init__(self, sample: Sample, tools: Mapping[str, Tool]) -> None:
        self.name = "bad" if sample.group_index == 0 else "good"
        self.tools = tools

    def reset(self) -> str:
        return ""

    def step(self, action: str):
        result = run_tool_call(ToolCall(name=self.name), self.tools, 10.0)
        return result.output, True, {"tool_output": result.output}


async def test_a_blocking_tool_fails_only_its_sample(engine, tok) -> None:
    release = threading.Event()
    tools = {
        "bad": Tool(name="bad", fn=lambda: release.wait(30) and "late", timeout_s=0.5),
        "good": Tool(name="good", fn=lambda: "fine"),
    }
    config = make_config(
        stop_every=1, batch_size=3, n_samples_per_prompt=2, over_sampling_factor=1.0, max_turns=2
    )
    manager = AsyncRolloutManager(
        make_buffer(),
        config,
        engine,
        tokenizer=tok,
        env_factory=lambda s: _ToolEnv(s, tools),
        reward_fn=alternating_reward(lambda g: 0),
    )
    try:
        batch = await manager.generate_batch()  # group 0 failed; a top-up group replaced it
    finally:
        release.set()
    assert batch.metadata["failed_samples"] == 2
    assert batch.metadata["errors"][0].startswith("tool bad timed out after 0.5 s")
    kept = [s for g in batch.groups for s in g]
    assert kept and all(s.metadata["env_info"]["tool_output"] == "fine" for s in kept)
    assert manager.threads.timed_out == 2


async def test_a_blocking_env_step_and_generate_fn_time_out_with_their_names(engine, tok) -> None:
    release = threading.Event()

    class StuckEnv:
        def __init__(self, sample: Sample) -> None:
            pass

        def reset(self) -> str:
            return ""

        def step(self, action: str):
            release.wait(30)
            return "", True, {}

    sample = Sample(index=0, group_index=0, prompt="q:")
    ctx = GenerateContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(len(tok)))),
        rid="stuck-0",
        max_turns=2,
        env_factory=StuckEnv,
        env_timeout_s=0.3,
    )
    try:
        with pytest.raises(Exception, match=r"env.step timed out after 0.3 s"):
            await generate_multi_turn(sample, ctx)
    finally:
        release.set()

    async def sleepy(sample: Sample, ctx: GenerateContext) -> Sample:
        if sample.group_index == 0:
            await trio.sleep_forever()
        return await generate_single_turn(sample, ctx)

    config = make_config(
        batch_size=2, n_samples_per_prompt=1, over_sampling_factor=1.0, generate_timeout_s=0.5
    )
    manager = AsyncRolloutManager(
        make_buffer(), config, engine, tokenizer=tok, generate_fn=sleepy, reward_fn=lambda s: 1.0
    )
    batch = await manager.generate_batch()  # group 0 failed; a top-up group replaced it
    assert len(batch.groups) == 2
    assert batch.metadata["errors"] == [
        "generate_fn (rollout.generate_timeout_s) timed out after 0.5 s "
        "(0 abandoned thread(s) still running)"
    ]


async def test_an_async_tool_is_awaited(engine, tok) -> None:
    async def lookup() -> str:
        await trio.sleep(0)
        return "async-ok"

    tools = {"good": Tool(name="good", fn=lookup), "bad": Tool(name="bad", fn=lookup)}
    sample = Sample(index=0, group_index=1, prompt="q:")
    ctx = GenerateContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(len(tok)))),
        rid="async-tool-0",
        max_turns=2,
        env_factory=lambda s: _ToolEnv(s, tools),
    )
    out = await generate_multi_turn(sample, ctx)
    assert out.metadata["env_info"]["tool_output"] == "async-ok"


async def test_a_multi_turn_prompt_too_long_fails_like_single_turn(engine, tok) -> None:
    sample = Sample(index=0, group_index=0, prompt="a much too long prompt " * 4)
    outs = []
    for generate, turns in ((generate_single_turn, 1), (generate_multi_turn, 2)):
        ctx = GenerateContext(
            engine=engine,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=8),
            rid=f"long-{turns}",
            max_total_tokens=20,
            max_turns=turns,
        )
        prompt = [{"role": "user", "content": sample.prompt}]
        outs.append(await generate(Sample(index=0, group_index=0, prompt=prompt), ctx))
    for out in outs:
        assert out.status is Status.FAILED
        assert "leaves no room under max_total_tokens=20" in out.metadata["error"]


async def test_tools_inside_env_steps_never_starve_for_threads() -> None:
    """Every outer slot held by a sync env.step that calls a tool: the tools still run."""
    runner = ThreadRunner(max_threads=2)
    tools = {"good": Tool(name="good", fn=lambda: "fine")}
    envs = [_ToolEnv(Sample(index=i, group_index=1, prompt="p"), tools) for i in range(4)]
    outs: list[Any] = []

    async def step(env: _ToolEnv) -> None:
        outs.append(await runner.call("env.step", 10.0, env.step, "action"))

    async with trio.open_nursery() as nursery:
        for env in envs:
            nursery.start_soon(step, env)
    assert [o[0] for o in outs] == ["fine"] * 4
    assert runner.timed_out == 0
