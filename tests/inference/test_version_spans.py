"""A weight reload in place (keep-mode pause) during a request: the built-in server reports
which tokens each version produced, and the clients take the oldest (issue 17: a response
whose first tokens came from the old weights is not staleness 0)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rollouts.inference.launch import EngineProcess, engine_server_sync
from rollouts.inference.protocol import SamplingParams
from rollouts.inference.sglang import SGLangEngine, generate_body
from rollouts.inference.vllm import VLLMEngine, completion_body

LONG = SamplingParams(max_new_tokens=120, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    with engine_server_sync(tiny_model_dir, max_batch=4) as proc:
        yield proc


async def _reload_in_place_while(server, tiny_model_dir, request) -> tuple[Any, str, str]:
    """Run `request()` and reload the weights in place while it is running."""
    sync = SGLangEngine(server.url)
    old = await sync.weight_version()
    new = str(int(old) + 1) if old.isdigit() else "1"
    out: dict[str, Any] = {}

    async def run() -> None:
        out["answer"] = await request()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while (await sync.load()).running < 1:  # admitted: its first token exists
                await trio.sleep(0.005)
            await sync.pause("keep")
            await sync.update_weights_from_disk(str(tiny_model_dir), new)
            await sync.resume()
    finally:
        await sync.aclose()
    return out["answer"], old, new


def _check_spans(spans: list[dict[str, Any]], old: str, new: str, total: int) -> None:
    assert [s["version"] for s in spans] == [old, new]
    assert spans[0]["start"] == 0
    assert 1 <= spans[0]["end"] == spans[1]["start"] < total
    assert spans[1]["end"] == total


async def test_sglang_route_reports_version_spans(server, tiny_model_dir) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = generate_body([5, 6, 7], LONG, "span-sglang")
            return (await http.post("/generate", json=body)).json()

        answer, old, new = await _reload_in_place_while(server, tiny_model_dir, request)
    meta = answer["meta_info"]
    assert meta["weight_version"] == new  # SGLang: the version at the end
    _check_spans(meta["weight_versions"], old, new, len(answer["output_ids"]))


async def test_vllm_route_reports_version_spans(server, tiny_model_dir) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = completion_body([5, 6, 7], LONG, "span-vllm", None)
            return (await http.post("/v1/completions", json=body)).json()

        answer, old, new = await _reload_in_place_while(server, tiny_model_dir, request)
    choice = answer["choices"][0]
    _check_spans(choice["weight_versions"], old, new, len(choice["token_ids"]))


@pytest.mark.parametrize("client", [SGLangEngine, VLLMEngine])
async def test_clients_take_the_oldest_version(server, tiny_model_dir, client) -> None:
    """The generating client did not run the sync itself: only the server can tell it."""
    engine = client(server.url)
    try:
        completion, old, new = await _reload_in_place_while(
            server, tiny_model_dir, lambda: engine.generate([5, 6, 7], LONG, rid="span-client")
        )
    finally:
        await engine.aclose()
    assert completion.completion_tokens == LONG.max_new_tokens
    assert completion.weight_version == old != new
