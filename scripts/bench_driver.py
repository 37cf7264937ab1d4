"""Benchmark: the RL driver at GPU-cluster batch sizes, against engines that answer at once.

Starts `--engines` real HTTP engine processes (`scripts/instant_engine.py`: SGLang's wire, no
model, responses of seeded lengths up to 4k tokens with per-token logprobs), then for each step
size runs, in a fresh child process (its own peak RSS), what an RL step runs outside generation
and training: the DataBuffer, the AsyncRolloutManager (over-sampling x1.5, the reward-std
filter, one request per group) over an EnginePool of SGLang clients, a sync reward on the
decoded text (as the driver wraps it), prepare_groups and the rollout metrics, and `train_step`
(GRPO advantages, the TrainBatch, mini-batches) on a `RemoteBackend` whose link pickles each
call as the trainer process's link does and answers at once: only the trainer's compute is
stubbed. The baseline is raw HTTP: the same group requests posted with httpx, answers read as
bytes, in the same child, before the driver's step.

    nice -n 10 python scripts/bench_driver.py [--sizes 1024,8192,32768] [--engines 16]
        [--client-processes N] [--malloc kept|system]

`--client-processes N`: the driver's generation calls in N worker processes
(`engines.client_processes`). `--malloc`: glibc keeps freed memory, as the driver's entry points
set it (`rollouts/heap.py`; the default), or glibc's defaults (`system`).

Per size: kept samples/s of the whole step (the engines answer at once, so the step is the
driver's work), its ratio to the raw baseline, the tail (the last answer's arrival to the batch
ready for the trainer), the generation time of the step's tokens at 100k tokens/s and the
tail's share of it (goal < 2%), the driver's CPU per sample, the servers' CPU (from /proc:
far below the driver's shows the driver, not the servers, is measured) and the peak RSS.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GEN_TOKENS_PER_S = 100_000.0
HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path.home() / ".cache/rollouts/models/smollm2-135m-instruct"
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be")


def payload(tokenizer: Any, seed: int) -> dict[str, Any]:
    """The servers' token pool (ids, logprobs, decoded pieces; a tenth digits, so rewards read
    numbers) and the table of response lengths: lognormal, median 600, at most 4096."""
    rng = random.Random(seed)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    vocab = len(tokenizer)
    ids = [
        rng.choice(digits) if rng.random() < 0.1 else rng.randrange(100, vocab)
        for _ in range(12288)
    ]
    return {
        "ids": ids,
        "logprobs": [-abs(rng.gauss(0.0, 1.5)) for _ in ids],
        "pieces": [tokenizer.decode([t]) for t in ids],
        "lengths": [min(max(int(rng.lognormvariate(6.4, 0.9)), 8), 4096) for _ in range(65536)],
        "eos": tokenizer.eos_token_id,
    }


def prompts(n: int, seed: int) -> list[Any]:
    """Chat prompts of lognormal length (median ~150 words, at most 1500); the label is the
    modulus a right answer's last number has: 1 (every answer right), 2 or 3 (some), or one no
    number reaches (none): a quarter of the groups carry no signal and the filter drops them."""
    from rollouts.types import PromptItem

    rng = random.Random(seed)
    items = []
    for i in range(n):
        words = min(max(int(rng.lognormvariate(5.0, 0.6)), 10), 1500)
        text = " ".join(rng.choice(WORDS) for _ in range(words)) + f" What is {i} + {i + 1}?"
        label = rng.choice([1, 2, 2, 3, 3, 3, 10**12, 2])
        items.append(PromptItem(index=i, prompt=({"role": "user", "content": text},), label=label))
    return items


def last_number_reward(sample: Any) -> float:
    """1.0 when the response's last number is a multiple of the label (a math-style check on the
    decoded text, `metadata["response_text"]`)."""
    tail = sample.metadata["response_text"][-200:]
    digits = "".join(c if c.isdigit() else " " for c in tail).split()
    return float(bool(digits) and int(digits[-1]) % sample.label == 0)


class StubLink:
    """A `BackendLink` whose far side trains instantly: each call is pickled exactly as the
    trainer process's link pickles it (`process_wire`), then answered here."""

    def __init__(self) -> None:
        self.sent_bytes = 0

    def call(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        import torch

        from rollouts.trainer.process_wire import dumps, pack

        self.sent_bytes += len(dumps(name, (0, name, tuple(map(pack, args)), kwargs)))
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if name == "compute_logprobs":  # the trainer's answer: a float per token
            future.set_result(tuple(torch.zeros(len(t)) for t in args[0].input_ids))
        else:
            future.set_result({"loss": 0.0} if name == "forward_backward" else {"grad_norm": 0.0})
        return future

    def pin_thread(self, cores: tuple[int, ...]) -> None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class Arrivals:
    """The engine pool, with the time its last generation answer arrived."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.last = pool, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    async def generate_many(self, requests: Any) -> Any:
        out = await self.pool.generate_many(requests)
        self.last = time.perf_counter()
        return out


class GcClock:
    """Seconds the cyclic garbage collector ran (every generation), from `gc.callbacks`."""

    def __init__(self) -> None:
        self.total_s, self._start = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start


class RssPeak:
    """The process's RSS sampled every 20 ms on a thread: the peak while it runs."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> RssPeak:
        self.peak = self.now()
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.peak = max(self.peak, self.now())


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def own_sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


async def raw_baseline(urls: list[str], bodies: list[bytes], in_flight: int) -> float:
    """Seconds to post `bodies` round-robin to `urls` (at most `in_flight` at once), each answer
    read as bytes: the servers and the transport, without the driver."""
    import httpx
    import trio

    per_url = max(in_flight // len(urls), 1)  # one small pool per server, as the clients shard
    limits = httpx.Limits(max_connections=per_url, max_keepalive_connections=per_url)
    clients = [httpx.AsyncClient(base_url=u, limits=limits, timeout=300.0) for u in urls]
    limiter = trio.CapacityLimiter(in_flight)
    headers = {"content-type": "application/json"}

    async def one(i: int) -> None:
        async with limiter:
            r = await clients[i % len(urls)].post("/generate", content=bodies[i], headers=headers)
            assert r.status_code == 200 and r.content, r.status_code

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.aclose()
    return elapsed


def group_bodies(tokenizer: Any, items: list[Any], n: int, max_new: int) -> list[bytes]:
    """The /generate body of each prompt's group (n seeded samples), as the manager sends it."""
    from rollouts.data.sft import tokenize_prompt
    from rollouts.inference.sglang_wire import batch_generate_body
    from rollouts.wire.generation import GenerateRequest, SamplingParams

    bodies = []
    for item in items:
        ids = tuple(tokenize_prompt(tokenizer, item.prompt))
        requests = [
            GenerateRequest(
                input_ids=ids,
                sampling=SamplingParams(max_new_tokens=max_new, seed=item.index * n + i),
                rid=f"base-g{item.index}-s{i}",
            )
            for i in range(n)
        ]
        bodies.append(json.dumps(batch_generate_body(requests)).encode())
    return bodies


def configs(args: argparse.Namespace, groups: int) -> Any:
    from rollouts.config import AlgorithmConfig, Config, RolloutConfig, SamplingConfig

    rollout = RolloutConfig(
        batch_size=groups,
        n_samples_per_prompt=args.n,
        over_sampling_factor=1.5,
        max_over_sampling_rounds=8,
        filters=["check_reward_nonzero_std"],
        max_concurrency=args.concurrency,
        max_total_tokens=8192,
        sampling=SamplingConfig(max_new_tokens=4096, temperature=1.0),
    )
    mini = max(groups // args.mini_batches, 1)
    return Config(rollout=rollout, algorithm=AlgorithmConfig(mini_batch_size=mini))


async def driver_steps(args: argparse.Namespace, urls: list[str], server_pids: list[int]) -> dict:
    """Baseline, then `args.steps` driver steps of `args.size` samples; the last step's figures."""
    import trio
    from transformers import AutoTokenizer

    from rollouts.data.buffer import DataBuffer
    from rollouts.driver.setup import with_response_text
    from rollouts.gcpolicy import freeze_startup_objects
    from rollouts.heap import keep_freed_memory
    from rollouts.inference.http import HttpOptions
    from rollouts.inference.pool import EnginePool
    from rollouts.inference.sglang import SGLangEngine
    from rollouts.loop.batch import prepare_groups, rollout_metrics
    from rollouts.loop.sources import BatchSource
    from rollouts.loop.train_step import train_step
    from rollouts.rollout.manager import AsyncRolloutManager
    from rollouts.trainer.remote import RemoteBackend

    tok = AutoTokenizer.from_pretrained(args.model)
    groups = args.size // args.n
    config = configs(args, groups)
    items = prompts(groups * 3 * (args.steps + 1), args.seed)
    bodies = group_bodies(tok, items[-groups:], args.n, 4096)
    servers0 = cpu_s(server_pids)
    base_s = await raw_baseline(urls, bodies, max(args.concurrency // args.n, 1))
    base_servers = cpu_s(server_pids) - servers0
    del bodies
    options = HttpOptions(client_processes=args.client_processes)
    pool = EnginePool([SGLangEngine(u, options=options) for u in urls], health_interval_s=5.0)
    engines = Arrivals(pool)
    buffer = DataBuffer(items[:-groups], seed=args.seed)
    reward = with_response_text(last_number_reward, tok)
    manager = AsyncRolloutManager(buffer, config.rollout, engines, tokenizer=tok, seed=args.seed)
    source = BatchSource(manager, reward, buffer, lambda number: ("0", 1))
    link = StubLink()
    freeze_startup_objects()  # as the RL phase does once it is set up
    if args.malloc == "kept":
        keep_freed_memory()  # as the driver's entry points do (`rollouts/heap.py`)
    gc_clock = GcClock()
    backend = RemoteBackend(link, adapters=False, snapshots=False)
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run_health_checks)
        for number in range(1, args.steps + 1):
            cpu0, servers0, start = own_cpu_s(), cpu_s(server_pids), time.perf_counter()
            sys0 = own_sys_s()
            gc0 = gc_clock.total_s
            with RssPeak() as rss:
                rss_start = rss.peak
                rollout, _ = await source.next(number)
                collected = time.perf_counter()
                prep = prepare_groups(rollout.groups, "0", 1)
                metrics = rollout_metrics(prep.groups, rollout.metadata)
                trained = await train_step(backend, prep.groups, config.algorithm, config, None)
                ready = time.perf_counter()
            samples = sum(len(g) for g in prep.groups)
            tokens = int(rollout.metadata["generated_tokens"])
            out = {
                "size": args.size,
                "samples": samples,
                "step_s": ready - start,
                "tail_s": ready - engines.last,
                "collect_s": collected - start,
                "build_s": ready - collected,
                "samples_per_s": samples / (ready - start),
                "base_samples_per_s": groups * args.n / base_s,
                "base_servers_cpu_s": base_servers,
                "gen_tokens": tokens,
                "kept_tokens": sum(s.response_length for g in prep.groups for s in g),
                "gen_s_at_100k": tokens / GEN_TOKENS_PER_S,
                "driver_cpu_s": own_cpu_s() - cpu0,
                "driver_sys_s": own_sys_s() - sys0,
                "gc_s": gc_clock.total_s - gc0,
                "servers_cpu_s": cpu_s(server_pids) - servers0,
                "rss_start_mb": rss_start / 2**20,
                "rss_peak_mb": rss.peak / 2**20,
                "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "reward_mean": metrics["reward/mean"],
                "dropped": rollout.metadata.get("dropped_groups", 0),
                "sent_mb": link.sent_bytes / 2**20,
                "train_tokens": trained.metrics["train/tokens"],
            }
            link.sent_bytes = 0
            print(f"[child] step {number}: {json.dumps(out)}", file=sys.stderr, flush=True)
            del rollout, prep, trained
        pool.closed = True
        nursery.cancel_scope.cancel()
    await pool.aclose()
    return out


def start_servers(count: int, payload_path: Path) -> tuple[list[subprocess.Popen], list[str]]:
    from rollouts.wire.ports import free_port

    procs, urls = [], []
    for _ in range(count):
        port = free_port()
        cmd = [sys.executable, str(HERE / "instant_engine.py"), "--port", str(port)]
        procs.append(subprocess.Popen([*cmd, "--payload", str(payload_path)]))
        urls.append(f"http://127.0.0.1:{port}")
    import httpx

    deadline = time.monotonic() + 60
    for url, proc in zip(urls, procs, strict=True):
        while True:
            assert proc.poll() is None, f"{url} exited"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{url} did not start"
            time.sleep(0.1)
    return procs, urls


def run_child(args: argparse.Namespace, size: int, urls: list[str], pids: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--size", str(size), "--urls", ",".join(urls)]
    cmd += ["--pids", ",".join(map(str, pids)), "--steps", str(args.steps), "--n", str(args.n)]
    cmd += ["--concurrency", str(args.concurrency), "--model", str(args.model)]
    cmd += ["--mini-batches", str(args.mini_batches), "--seed", str(args.seed)]
    cmd += ["--client-processes", str(args.client_processes), "--malloc", args.malloc]
    cmd += ["--profile", f"{args.profile}.{size}"] if args.profile else []
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> None:
    print(
        "| samples | driver samples/s | raw HTTP samples/s | ratio | tail | gen at 100k tok/s "
        "| tail / gen | step / gen | driver CPU / sample | servers CPU / driver CPU | GC "
        "| peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['samples']} | {r['samples_per_s']:.0f} | {r['base_samples_per_s']:.0f} "
            f"| {r['samples_per_s'] / r['base_samples_per_s']:.2f} | {r['tail_s']:.2f} s "
            f"| {r['gen_s_at_100k']:.0f} s | {r['tail_s'] / r['gen_s_at_100k']:.2%} "
            f"| {r['step_s'] / r['gen_s_at_100k']:.1%} "
            f"| {r['driver_cpu_s'] / r['samples'] * 1e3:.2f} ms "
            f"| {r['servers_cpu_s'] / r['driver_cpu_s']:.2f} "
            f"| {r['gc_s']:.1f} s | {r['rss_peak_mb']:.0f} MB |"
        )
    first = rows[0]
    for r in rows[1:]:
        k = r["samples"] / first["samples"]
        print(
            f"{first['samples']} -> {r['samples']} samples (x{k:.0f}): step time "
            f"x{r['step_s'] / first['step_s']:.1f}, tail x{r['tail_s'] / first['tail_s']:.1f}, "
            f"peak RSS x{r['rss_peak_mb'] / first['rss_peak_mb']:.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,8192,32768", help="samples per step")
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=2, help="steps per size (the last reported)")
    parser.add_argument("--concurrency", type=int, default=4096, help="rollout.max_concurrency")
    parser.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per step")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="its tokenizer is used")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--malloc",
        choices=("kept", "system"),
        default="kept",
        help="kept: glibc keeps freed memory, as the driver sets it; system: glibc's defaults",
    )
    parser.add_argument(
        "--client-processes", type=int, default=0, help="engines.client_processes of the driver"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--urls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pids", default="", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="", help="the child's main thread: cProfile to FILE")
    args = parser.parse_args()
    if args.child:
        import trio

        pids = [int(p) for p in args.pids.split(",")]
        if args.profile:  # the main thread, in CPU seconds
            import cProfile

            prof = cProfile.Profile(time.process_time)
            result = prof.runcall(trio.run, driver_steps, args, args.urls.split(","), pids)
            prof.dump_stats(args.profile)
            print(json.dumps(result))
            return

        print(json.dumps(trio.run(driver_steps, args, args.urls.split(","), pids)))
        return
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "payload.json"
        path.write_text(json.dumps(payload(AutoTokenizer.from_pretrained(args.model), args.seed)))
        procs, urls = start_servers(args.engines, path)
        try:
            pids = [p.pid for p in procs]
            rows = [run_child(args, int(s), urls, pids) for s in args.sizes.split(",")]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
    print(f"engines={args.engines} n={args.n} concurrency={args.concurrency} steps={args.steps}")
    table(rows)


if __name__ == "__main__":
    main()
