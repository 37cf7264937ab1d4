"""What a sleeping built-in engine gives back, on CPU: its resident memory awake, asleep at
level 1 and level 2, and after the wake-up and the reload; the time of each call.

    python scripts/bench_sleep.py [--model smollm2|tiny] [--rounds 3]

One engine process (the launcher's `rollouts serve`), its RSS read from /proc after each call
(the process's own VmRSS, not the box's free memory). A round: a 16-request greedy batch (so the
KV cache is in use), sleep, wake-up, reload, the same batch again, which must give the same
tokens. Prints the medians and the RSS ratio asleep / awake.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.engine.launch import engine_process
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.sources import fetch_source
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.wire.generation import SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0)
TINY = TinyModelSpec(  # the demo's model (configs/demo-cpu.toml)
    hidden_size=128, num_layers=3, num_heads=4, intermediate_size=512, max_position_embeddings=256
)


def model_dir(name: str) -> Path:
    if name == "tiny":
        return make_tiny_model(Path("runs/bench-sleep/tiny"), TINY)
    return fetch_source("smollm2-135m-instruct")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def batch(engine: VLLMEngine) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []

    async def one(i: int) -> None:
        out.append((await engine.generate([1, 2 + i, 3, 4], GREEDY)).output_ids)

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(one, i)
    return sorted(out)


async def timed(call) -> float:
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


async def main(model: Path, rounds: int) -> None:
    rows: dict[str, list[float]] = {}
    async with engine_process(model, torch_threads=1) as proc:
        engine = VLLMEngine(proc.url)
        pid = proc.process.pid
        for _ in range(rounds):
            for level in (1, 2):
                before = await batch(engine)
                awake = rss_mb(pid)
                sleep_s = await timed(engine.sleep(level))
                asleep = rss_mb(pid)
                wake_s = await timed(engine.wake_up())
                reload_s = await timed(engine.update_weights_from_disk(str(model), "1"))
                assert await batch(engine) == before, "other tokens after the wake-up"
                for key, value in {
                    "awake MB": awake,
                    "asleep MB": asleep,
                    "asleep / awake": asleep / awake,
                    "sleep s": sleep_s,
                    "wake s": wake_s,
                    "reload s": reload_s,
                }.items():
                    rows.setdefault(f"level {level}: {key}", []).append(value)
        await engine.aclose()
    for key, values in rows.items():
        print(f"{key:28s} {statistics.median(values):10.3f}   ({len(values)} rounds)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, model_dir(args.model), args.rounds)
