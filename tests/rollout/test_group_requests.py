"""A GRPO group as ONE engine request (`rollout.batch_groups`), against the real built-in server.

The manager sends a group's samples as one batch /generate; each sample keeps its own request
id, so the surplus abort and an abort by prefix reach exactly the samples they name, and a batch
the server refuses is sent again sample by sample so that only the bad sample fails.
"""

from __future__ import annotations

import collections
import dataclasses
import socket

import httpx
import trio

from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.engine.launch import EngineProcess
from rollouts.inference.http import HttpOptions
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import batches_requests
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import batch_generate_body
from rollouts.rollout.generate import generate_group_single_turn, generate_single_turn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import PromptItem, Sample, Status
from rollouts.wire.generation import FinishReason, GenerateRequest, SamplingParams
from tests.rollout import manager_cases as cases


class CountingTransport(httpx.AsyncHTTPTransport):
    """A real HTTP transport that counts the requests per path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: collections.Counter[str] = collections.Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
        return await super().handle_async_request(request)


async def _batch(server: EngineProcess, tok, batch_groups: bool) -> tuple[object, int]:
    transport = CountingTransport()
    engine = SGLangEngine(server.url, transport=transport)
    config = cases.make_config(
        batch_size=3, n_samples_per_prompt=4, over_sampling_factor=1.0, batch_groups=batch_groups
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    assert manager.batch_groups is batch_groups
    try:
        batch = await manager.generate_batch(cases.alternating_reward(lambda g: False))
    finally:
        await engine.aclose()
    return batch, transport.paths["/generate"]


async def test_a_group_is_one_request(server: EngineProcess, tok) -> None:
    """3 groups of 4: 3 /generate calls batched, 12 one by one; the same samples either way."""
    batched, calls = await _batch(server, tok, batch_groups=True)
    single, single_calls = await _batch(server, tok, batch_groups=False)
    assert (calls, single_calls) == (3, 12)
    for batch in (batched, single):
        assert len(batch.samples) == 12
        for s in batch.samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
            assert len(s.rollout_logprobs) == s.response_length > 0
            assert s.loss_mask == (0,) * s.prompt_length + (1,) * s.response_length
            assert s.weight_versions == ("default",)
    assert batched.metadata["failed_samples"] == 0


async def test_batch_answers_equal_single_answers(server: EngineProcess) -> None:
    """Greedy: each prompt of a batch gets what it gets alone (ids; logprobs within 1e-4)."""
    engine = SGLangEngine(server.url)
    try:
        requests = [
            GenerateRequest(
                input_ids=tuple(range(5, 5 + k)),
                sampling=SamplingParams(max_new_tokens=6 + 3 * k, temperature=0.0, ignore_eos=True),
                rid=f"eq-{k}",
            )
            for k in range(1, 5)
        ]
        many = await engine.generate_many(requests)
        for request, got in zip(requests, many, strict=True):
            alone = await engine.generate(request.input_ids, request.sampling)
            assert got.output_ids == alone.output_ids
            assert len(got.output_ids) == request.sampling.max_new_tokens
            assert max(abs(a - b) for a, b in zip(got.logprobs, alone.logprobs, strict=True)) < 1e-4
    finally:
        await engine.aclose()


def test_batch_body_keeps_each_prompts_rid_and_params() -> None:
    requests = [
        GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=3), rid="b-s0"),
        GenerateRequest(input_ids=(1, 2, 9), sampling=SamplingParams(max_new_tokens=1), rid="b-s1"),
    ]
    body = batch_generate_body(requests)
    assert body["input_ids"] == [[1, 2], [1, 2, 9]]
    assert body["rid"] == ["b-s0", "b-s1"]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [3, 1]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1


async def test_abort_by_prefix_reaches_one_prompt_of_a_batch(server: EngineProcess) -> None:
    """Two prompts in one batch request: aborting one's rid prefix cuts only that one short."""
    engine = SGLangEngine(server.url)
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(input_ids=(5, 6), sampling=long, rid="keep-0"),
        GenerateRequest(input_ids=(7, 8), sampling=long, rid="cut-1"),
    ]
    got: list = []

    async def send() -> None:
        got.extend(await engine.generate_many(requests))

    try:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as http,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(send)
            with trio.fail_after(30):
                while (await http.get("/v1/loads")).json()["num_running_reqs"] < 2:
                    await trio.sleep(0.002)
            await http.post("/pause_generation", json={"mode": "in_place"})
            await engine.abort("cut-")
            await http.post("/continue_generation", json={})
    finally:
        await engine.aclose()
    keep, cut = got
    assert keep.finish_reason is FinishReason.LENGTH and len(keep.output_ids) == 400
    assert cut.finish_reason is FinishReason.ABORT and len(cut.output_ids) < 400


async def test_a_refused_batch_fails_only_the_bad_sample(server: EngineProcess, tok) -> None:
    """A resumed sample whose tokens fill the server's context (512) makes the server refuse
    the batch (HTTP 400); sent again one by one, only that sample fails."""
    engine = SGLangEngine(server.url)
    fresh = Sample(index=0, group_index=0, prompt="q0:")
    too_long = dataclasses.replace(
        fresh,
        index=1,
        tokens=(5,) * 520,
        loss_mask=(0,) * 500 + (1,) * 20,
        response_length=20,
        rollout_logprobs=(-1.0,) * 20,
        weight_versions=("default",),
        status=Status.ABORTED,
    )
    ctx = GenerateContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
        rid="refused-s0",
        max_total_tokens=2000,
    )
    try:
        out = await generate_group_single_turn(
            [fresh, too_long, dataclasses.replace(fresh, index=2)],
            ctx,
            ["refused-s0", "refused-s1", "refused-s2"],
        )
    finally:
        await engine.aclose()
    assert [s.status is Status.FAILED for s in out] == [False, True, False]
    assert "HTTP 400" in out[1].metadata["error"] and "context" in out[1].metadata["error"]
    for s in (out[0], out[2]):
        assert s.response_length > 0 and len(s.rollout_logprobs) == s.response_length


async def test_pool_moves_a_refused_connection_batch_to_the_next_engine(
    server: EngineProcess,
) -> None:
    """An EnginePool whose first engine is gone (nothing listens on its port) sends the whole
    batch to the next one; the dead one is marked down. A pool batches only if every engine does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again: connections are refused
    options = HttpOptions(max_retries=1, backoff_s=0.01, timeout_s=30)
    engines = [
        SGLangEngine(f"http://127.0.0.1:{dead_port}", options=options),
        SGLangEngine(server.url, options=options),
    ]
    pool = EnginePool(engines)
    assert batches_requests(pool)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(input_ids=(5, 6, 7), sampling=greedy, rid=f"p-{i}") for i in range(3)
    ]
    try:
        got = await pool.generate_many(requests)
        assert [len(c.output_ids) for c in got] == [5, 5, 5]
        assert pool.up == [False, True]
        engines[1].batch_generate = False  # an engine that cannot batch: the pool cannot either
        assert not batches_requests(pool)
    finally:
        await pool.aclose()


async def test_eval_sends_prompts_in_batches_with_the_same_greedy_answers(
    server: EngineProcess, tok
) -> None:
    """20 eval prompts: 2 batch /generate calls (16 + 4), the same tokens as one by one."""
    items = [PromptItem(index=i, prompt=f"q{i}:") for i in range(20)]
    transport = CountingTransport()
    engine = SGLangEngine(server.url, transport=transport)
    try:
        batched = await evaluate(engine, tok, items, lambda s: 1.0, EvalSpec(max_new_tokens=12))
        assert transport.paths["/generate"] == 2
        one_by_one = EvalSpec(max_new_tokens=12, generate_fn=generate_single_turn)
        single = await evaluate(engine, tok, items, lambda s: 1.0, one_by_one)
        assert transport.paths["/generate"] == 2 + 20
    finally:
        await engine.aclose()
    assert batched.failed == single.failed == 0
    assert [s.tokens for s in batched.samples] == [s.tokens for s in single.samples]
    assert [s.index for s in batched.samples] == list(range(20))
