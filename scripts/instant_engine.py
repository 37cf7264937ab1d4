"""An engine server with no model, for driver benchmarks: it answers SGLang's routes at once.

    python scripts/instant_engine.py --port 30000 --payload PAYLOAD.json

`/generate` (one prompt, or a batch: SGLang's list form) answers each prompt with a response of
a length drawn from the payload's seeded table (indexed by the request's `sampling_seed`, else
by its rid), capped by `max_new_tokens` (then finish reason "length", else "stop"), with its
`output_ids`, per-token `output_token_logprobs` and `text`, in SGLang's wire format
(`/work/shared/reference/engine-protocols.md`). The responses are slices of one precomputed
token pool whose JSON is encoded once at start, so a request costs the server a JSON decode of
its (small) body and a few byte slices: the server is never what a benchmark of the driver
measures (`scripts/bench_driver.py` reads its CPU time to show it). The control routes a pool
calls (`/health`, `/model_info`, `/server_info`, `/v1/loads`, `/abort_request`, pauses, a
reload) answer as SGLang does. asyncio and the standard library only: a cheap process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import zlib
from typing import Any

HEADERS_END = b"\r\n\r\n"


class Pool:
    """The precomputed response pieces: byte offsets into one encoded pool per field."""

    def __init__(self, payload: dict[str, Any]) -> None:
        ids, logprobs, pieces = payload["ids"], payload["logprobs"], payload["pieces"]
        assert len(ids) == len(logprobs) == len(pieces), "the pool's fields differ in length"
        self.lengths: list[int] = payload["lengths"]
        self.eos: int = payload["eos"]
        self.window = len(ids) - max(self.lengths)  # where a response may start
        assert self.window > 0, "the pool is shorter than the longest response"
        self.ids, self.ids_at = _joined([f"{t}," for t in ids])
        self.lps, self.lps_at = _joined(
            [f"[{lp:.6f},{t},null]," for lp, t in zip(logprobs, ids, strict=True)]
        )
        escaped = [json.dumps(p)[1:-1] for p in pieces]
        self.text, self.text_at = _joined(escaped)

    def answer(self, seed: int, max_new: int, rid: str, prompt_tokens: int) -> bytes:
        """One prompt's answer object, JSON-encoded."""
        length = min(self.lengths[seed % len(self.lengths)], max_new)
        start = (seed * 7919) % self.window
        end = start + length
        ids = self.ids[self.ids_at[start] : self.ids_at[end] - 1]
        lps = self.lps[self.lps_at[start] : self.lps_at[end] - 1]
        text = self.text[self.text_at[start] : self.text_at[end]]
        if length >= max_new:
            reason = b'{"type":"length","length":%d}' % length
        else:
            reason = b'{"type":"stop","matched":%d}' % self.eos
        meta = b'{"id":%s,"prompt_tokens":%d,"completion_tokens":%d,"cached_tokens":0,' % (
            json.dumps(rid).encode(),
            prompt_tokens,
            length,
        )
        return (
            b'{"text":"'
            + text
            + b'","output_ids":['
            + ids
            + b'],"meta_info":'
            + meta
            + b'"weight_version":"0","finish_reason":'
            + reason
            + b',"output_token_logprobs":['
            + lps
            + b'],"e2e_latency":0.0}}'
        )


def _joined(parts: list[str]) -> tuple[bytes, list[int]]:
    """The parts as one byte string and the offset where each starts (plus the end)."""
    encoded = [p.encode() for p in parts]
    offsets = [0]
    for e in encoded:
        offsets.append(offsets[-1] + len(e))
    return b"".join(encoded), offsets


def _seed_of(params: dict[str, Any], rid: str) -> int:
    seed = params.get("sampling_seed")
    return int(seed) if seed is not None else zlib.crc32(rid.encode())


def generate(pool: Pool, body: dict[str, Any]) -> bytes:
    """The answer of a /generate body: one object, or a list for a batch."""
    ids = body["input_ids"]
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = body.get("rid") or [f"r{i}" for i in range(len(prompts))]
    rids = rids if isinstance(rids, list) else [rids]
    answers = [
        pool.answer(_seed_of(p, rid), int(p.get("max_new_tokens", 128)), rid, len(prompt))
        for prompt, p, rid in zip(prompts, params, rids, strict=True)
    ]
    return b"[" + b",".join(answers) + b"]" if batch else answers[0]


CONTROL = {
    "/health": b"{}",
    "/model_info": b'{"model_path":"instant","weight_version":"0","is_generation":true}',
    "/server_info": b'{"version":"instant","tp_size":1}',
    "/v1/loads": b'{"num_running_reqs":0,"num_waiting_reqs":0}',
    "/abort_request": b"{}",
    "/pause_generation": b"{}",
    "/continue_generation": b"{}",
    "/flush_cache": b"{}",
    "/update_weights_from_disk": b'{"success":true,"message":"ok","num_paused_requests":0}',
}


class Http(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: what httpx sends."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(HEADERS_END)) >= 0:
            head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            size = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    size = int(value)
            if len(self.buffer) < end + 4 + size:
                return  # the body is still coming
            body = bytes(self.buffer[end + 4 : end + 4 + size])
            del self.buffer[: end + 4 + size]
            self.respond(head[0].split(" ")[1].split("?")[0], body)

    def respond(self, path: str, body: bytes) -> None:
        status = b"200 OK"
        if path == "/generate":
            answer = generate(self.pool, json.loads(body))
        elif path in CONTROL:
            answer = CONTROL[path]
        else:
            status, answer = b"404 Not Found", b'{"detail":"Not Found"}'
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 "
            + status
            + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(answer)).encode()
            + b"\r\n\r\n"
            + answer
        )


async def serve(port: int, pool: Pool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Http(pool), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--payload", required=True, help="JSON: ids, logprobs, pieces, lengths, eos"
    )
    args = parser.parse_args()
    with open(args.payload) as f:
        pool = Pool(json.load(f))
    asyncio.run(serve(args.port, pool))


if __name__ == "__main__":
    main()
