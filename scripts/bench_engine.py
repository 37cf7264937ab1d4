"""Benchmark: the built-in engine server vs in-process padded `model.generate`, same process.

The RL-shaped workload of issue 11: 16 prompts x 8 samples = 128 sequences, temperature 1,
top-k/top-p off, EOS ignored so lengths are exact, the logprob of every sampled token returned,
each request seeded as a run seeds it (`--unseeded`: none).
Two cases: every sequence 64 new tokens ("equal"), and each sequence its own length, uniform in
4..64 ("varying"). The baseline is what TRL does: one left-padded `generate` call over the 128
rows (each prompt repeated 8 times), run to the longest length, with the logprobs gathered from
its logits; only the requested tokens count. The server gets the 128 sequences as 128 concurrent
requests through the SGLang and the vLLM client (one request per sample, as the rollout manager
sends them with `rollout.batch_groups = false` or to vLLM), and as 16 batch requests, one per
group, through `SGLangEngine.generate_many` ("groups": what the rollout manager sends by default
to SGLang's API and the built-in server). Both sides use the same number of torch threads
(`--threads`, default 1, as issue 11 measured). Each rep runs the baseline and then the server
runs, and each ratio is taken against the baseline of its own rep (the machine's load drifts).
Below the table: the server's own account from its DEBUG log (decode steps, ms per step,
prefills), the time from the client's start to the first admission and from the drained batch to
the last answer (HTTP), and the CPU seconds of the server process and of the client.

    .venv/bin/python scripts/bench_engine.py [--reps 2] [--hidden 128] [--layers 3]
    python scripts/bench_engine.py --device cuda --dtype bfloat16 --hidden 1024 --layers 24 \
        --prompts 32 --equal-len 256 --max-batch 256 --clients groups   # scripts/gpu_check.sh

On CUDA both sides run the same bf16 weights on the GPU (`--device`, `--dtype`), and the varying
case's lengths are uniform in 4..`--equal-len`.

To see where a decode step's time goes, profile the server process under this load with py-spy
(`pip install -e .[profile]`; `py-spy record -p SERVER_PID -f raw -o out.txt --threads -n`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio
from transformers import AutoModelForCausalLM

from rollouts.engine.launch import engine_process
from rollouts.inference.http import HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.wire.generation import GenerateRequest, SamplingParams

GOALS = {"equal": 1.0, "varying": 1.5}


def workload(
    prompts: int, group: int, seed: int, equal: int | None, longest: int = 64
) -> tuple[list[list[int]], list[int]]:
    """`prompts` prompts of 16-48 byte tokens, each repeated `group` times, and output lengths
    (all `equal`, or uniform in 4..`longest` per sequence)."""
    rng = random.Random(seed)
    base = [[rng.randrange(3, 259) for _ in range(rng.randint(16, 48))] for _ in range(prompts)]
    seqs = [p for p in base for _ in range(group)]
    lengths = [equal if equal is not None else rng.randint(4, longest) for _ in seqs]
    return seqs, lengths


@torch.inference_mode()
def baseline(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> float:
    """Seconds of one left-padded sampling `generate` call over all rows, logprobs included."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(lengths)
    ids, mask = ids.to(device), mask.to(device)
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits_B_T_V = torch.stack(out.logits, dim=1).float()
    new_B_T = out.sequences[:, width:]
    logprobs_B_T = logits_B_T_V.log_softmax(-1).gather(2, new_B_T.unsqueeze(2)).squeeze(2)
    assert logprobs_B_T.shape == (len(prompts), longest), f"{logprobs_B_T.shape=}"
    logprobs_B_T.cpu()  # as the server's answers are: on the host
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sampling_of(length: int, row: int, seeded: bool) -> SamplingParams:
    """Row `row`'s request: `length` new tokens at temperature 1, seeded with its row (as a
    run seeds every request, `rollout/seeds.py`) unless `seeded` is off."""
    seed = row if seeded else None
    return SamplingParams(max_new_tokens=length, temperature=1.0, ignore_eos=True, seed=seed)


async def through(
    client, prompts: list[list[int]], lengths: list[int], seeded: bool
) -> tuple[float, float]:
    """All requests sent at once through `client` (logprobs come back): (start, end) on the
    machine's monotonic clock."""
    done: list[int] = []

    async def one(p: list[int], n: int, row: int) -> None:
        c = await client.generate(p, sampling_of(n, row, seeded))
        assert len(c.logprobs) == n, f"{len(c.logprobs)=} != {n=}"
        done.append(c.completion_tokens)

    start = time.monotonic()
    if isinstance(client, GroupClient):
        done.append(await client.run(prompts, lengths, seeded))
    else:
        async with trio.open_nursery() as nursery:
            for row, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
                nursery.start_soon(one, p, n, row)
    end = time.monotonic()
    assert sum(done) == sum(lengths), f"{sum(done)=} != {sum(lengths)=}"
    return start, end


class GroupClient:
    """One batch /generate per group of identical prompts through the project's SGLang client
    (`SGLangEngine.generate_many`), as the rollout manager sends a GRPO group."""

    def __init__(self, engine: SGLangEngine, group: int) -> None:
        self.engine, self.group = engine, group

    async def run(self, prompts: list[list[int]], lengths: list[int], seeded: bool) -> int:
        """All groups at once; the number of tokens that came back (logprobs checked)."""
        got: list[int] = []

        async def one(first: int) -> None:
            rows = range(first, first + self.group)
            requests = [
                GenerateRequest(
                    input_ids=tuple(prompts[i]),
                    sampling=sampling_of(lengths[i], i, seeded),
                    rid=f"g{first}-s{i}",
                )
                for i in rows
            ]
            for c, i in zip(await self.engine.generate_many(requests), rows, strict=True):
                assert len(c.logprobs) == lengths[i], f"{len(c.logprobs)=} != {lengths[i]=}"
                got.append(c.completion_tokens)

        async with trio.open_nursery() as nursery:
            for first in range(0, len(prompts), self.group):
                nursery.start_soon(one, first)
        return sum(got)

    async def aclose(self) -> None:
        await self.engine.aclose()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drained(log_path: str) -> list[tuple[float, ...]]:
    """(start, end, decode steps, ms/step, prefills) of each "batch drained" line in the
    server's log (start and end on the machine's monotonic clock)."""
    found = re.findall(
        r"\(monotonic ([\d.]+)-([\d.]+)\): (\d+) decode steps, ([\d.]+) ms/step.*?; "
        r"(\d+) prefills",
        Path(log_path).read_text(),
    )
    return [tuple(float(x) for x in line) for line in found]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One timed run: wall and CPU seconds; for the server also its own account of it."""

    wall_s: float
    cpu_s: float
    client_cpu_s: float = 0.0  # the bench process's CPU while the client ran
    lead_s: float = 0.0  # client start -> first admission
    tail_s: float = 0.0  # batch drained -> last answer parsed by the client
    steps: float = 0.0
    ms_per_step: float = 0.0
    prefills: float = 0.0


async def server_run(
    client, proc, prompts: list[list[int]], lengths: list[int], seeded: bool
) -> Run:
    """Time one run through `client`, with the server's busy periods from its log."""
    pid, seen = proc.process.pid, len(drained(proc.log_path))
    cpu0, client_cpu0 = cpu_s(pid), time.process_time()
    start, end = await through(client, prompts, lengths, seeded)
    cpu, client_cpu = cpu_s(pid) - cpu0, time.process_time() - client_cpu0
    with trio.move_on_after(5):  # the worker logs the drain just after the last answer
        while len(drained(proc.log_path)) == seen:
            await trio.sleep(0.01)
    busy = drained(proc.log_path)[seen:]
    steps = sum(b[2] for b in busy)
    return Run(
        wall_s=end - start,
        cpu_s=cpu,
        client_cpu_s=client_cpu,
        lead_s=busy[0][0] - start if busy else float("nan"),
        tail_s=end - busy[-1][1] if busy else float("nan"),
        steps=steps,
        ms_per_step=sum(b[2] * b[3] for b in busy) / max(steps, 1),
        prefills=sum(b[4] for b in busy),
    )


async def run_all(model, model_dir: str, cases: dict, args: argparse.Namespace) -> dict:
    """{(case, side): [Run per rep]}; each rep times the baseline and both clients back to
    back, so a ratio compares runs under the same load of the machine."""
    options = HttpOptions(max_connections=args.connections, timeout_s=600)
    out: dict[tuple[str, str], list[Run]] = {}
    async with engine_process(
        model_dir,
        max_batch=args.max_batch,
        torch_threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        startup_timeout_s=300,
        extra_args=("--log-level", "DEBUG"),  # the core logs its ms/step when a batch drains
    ) as proc:
        clients = {
            "SGLang": lambda: SGLangEngine(proc.url, options=options),
            "vLLM": lambda: VLLMEngine(proc.url, options=options),
            "groups": lambda: GroupClient(SGLangEngine(proc.url, options=options), args.group),
        }
        clients = {side: clients[side]() for side in args.clients.split(",")}
        try:
            await timed_runs(model, proc, clients, cases, args, out)
        except BaseException:
            print(f"the server's log ({proc.log_path}) ends:\n{proc.log_tail(6000)}", flush=True)
            raise
        for client in clients.values():
            await client.aclose()
    return out


async def timed_runs(model, proc, clients: dict, cases: dict, args, out: dict) -> None:
    for client in clients.values():  # warm-up (and the connections opened)
        await through(client, *cases["varying"], not args.unseeded)
    baseline(model, *cases["equal"], 0)
    for _ in range(args.reps):
        for name, (prompts, lengths) in cases.items():
            cpu0 = time.process_time()
            wall = baseline(model, prompts, lengths, 0)
            run = Run(wall_s=wall, cpu_s=time.process_time() - cpu0)
            out.setdefault((name, "generate"), []).append(run)
            for side, client in clients.items():
                run = await server_run(client, proc, prompts, lengths, not args.unseeded)
                out.setdefault((name, side), []).append(run)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--equal-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each case (median)")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=0, help="0 = 4 x hidden")
    parser.add_argument("--device", default="cpu", help="both sides' device (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--clients", default="SGLang,vLLM,groups", help="which server clients")
    parser.add_argument(
        "--unseeded", action="store_true", help="requests without a seed (runs seed every one)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = tempfile.mkdtemp(prefix="bench-engine-")
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        max_position_embeddings=max(256, 64 + args.equal_len),
        seed=args.seed,
    )
    make_tiny_model(model_dir, spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    torch.manual_seed(args.seed)
    cases = {
        "equal": workload(args.prompts, args.group, args.seed, args.equal_len),
        "varying": workload(args.prompts, args.group, args.seed + 1, None, args.equal_len),
    }
    timed = trio.run(run_all, model, model_dir, cases, args)
    report(timed, cases, args)


def report(timed: dict, cases: dict, args: argparse.Namespace) -> None:
    """The table: tokens/s and ratios per case and client, then the server's own account."""
    med = statistics.median
    print(
        "SGLang, vLLM: one request per sequence through the project's clients (the rollout "
        "manager with batch_groups off, or on vLLM); groups: one batch /generate per group of "
        f"{args.group} (SGLangEngine.generate_many: what the manager sends by default)"
    )
    print(
        f"{args.prompts * args.group} sequences ({args.prompts} prompts x {args.group}), "
        f"temperature 1, logprobs; tiny Llama hidden {args.hidden}, {args.layers} layers, "
        f"{args.device} {args.dtype}; torch "
        f"threads {args.threads} per side (OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); {args.reps} reps: medians, each ratio "
        "taken per rep against the baseline run just before it"
    )
    sides = tuple(args.clients.split(","))
    heads = " ".join(f"{side + ' tok/s':>12} {'ratio':>5}" for side in sides)
    print(
        f"{'case':<8} {'tokens':>6} {'generate tok/s':>14} {heads} {'goal':>7}   "
        f"ratios per rep ({'/'.join(sides)})"
    )
    for name, (_, lengths) in cases.items():
        tokens, base = sum(lengths), timed[(name, "generate")]
        ratios = {
            side: [b.wall_s / r.wall_s for b, r in zip(base, timed[(name, side)], strict=True)]
            for side in sides
        }
        walls = {side: med(r.wall_s for r in timed[(name, side)]) for side in sides}
        reps = ", ".join(
            "/".join(f"{x:.2f}" for x in rep)
            for rep in zip(*(ratios[side] for side in sides), strict=True)
        )
        cols = " ".join(
            f"{tokens / walls[side]:>12.1f} {med(ratios[side]):>5.2f}" for side in sides
        )
        print(
            f"{name:<8} {tokens:>6} {tokens / med(b.wall_s for b in base):>14.1f} {cols} "
            f"{'>= ' + str(GOALS[name]) + 'x':>7}   {reps}"
        )
    for name, (_, lengths) in cases.items():
        base = timed[(name, "generate")]
        print(
            f"generate ({name}): {1000 * med(b.wall_s for b in base) / max(lengths):.1f} ms/step "
            f"(wall / {max(lengths)} steps, prefill included), "
            f"{med(b.cpu_s for b in base):.2f} CPU s"
        )
        for side in sides:
            runs = timed[(name, side)]
            print(
                f"server ({name}, {side}): {med(r.steps for r in runs):.0f} decode steps at "
                f"{med(r.ms_per_step for r in runs):.1f} ms/step, "
                f"{med(r.prefills for r in runs):.0f} prefills; client start -> first "
                f"admission {med(r.lead_s for r in runs):.2f} s, drained -> last answer "
                f"{med(r.tail_s for r in runs):.2f} s of {med(r.wall_s for r in runs):.2f} s; "
                f"CPU s: server {med(r.cpu_s for r in runs):.2f}, client "
                f"{med(r.client_cpu_s for r in runs):.2f}"
            )


if __name__ == "__main__":
    main()
