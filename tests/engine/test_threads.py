"""The CPU engine's thread governor (`rollouts/engine/threads.py`): it keeps all its threads on a
quiet machine, falls back to one when its steps show another process on its cores, and returns
when that process is gone; and the thread count never changes what the model computes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rollouts.engine.threads import ThreadGovernor


class Machine:
    """Seconds per row of a decode step at each thread count; `busy` = a neighbour on a core."""

    def __init__(self) -> None:
        self.busy = False
        self.threads_set: list[int] = []

    def per_row(self, threads: int) -> float:
        if threads == 1:
            return 1.0e-3
        return 4.0e-3 if self.busy else 0.6e-3  # the team waits for the starved thread


def run(gov: ThreadGovernor, machine: Machine, seconds: float, rows: int = 64) -> list[int]:
    """Decode steps for about `seconds`; the thread count of each step."""
    counts, elapsed = [], 0.0
    threads = gov.current
    while elapsed < seconds:
        took = machine.per_row(threads) * rows
        counts.append(threads)
        gov.step_done(rows, took)
        threads = machine.threads_set[-1] if machine.threads_set else gov.current
        elapsed += took
    return counts


def governor(machine: Machine) -> ThreadGovernor:
    return ThreadGovernor(most=2, set_threads=machine.threads_set.append, probe_share=1.0)


def test_a_quiet_machine_keeps_every_thread_and_probes_rarely() -> None:
    machine = Machine()
    gov = governor(machine)
    counts = run(gov, machine, seconds=60.0)
    assert gov.current == 2 and gov.switches == 0
    assert 0 < counts.count(1) <= 0.03 * len(counts), counts.count(1)


def test_a_busy_neighbour_makes_it_fall_back_to_one_thread_and_return_after() -> None:
    machine = Machine()
    gov = governor(machine)
    run(gov, machine, seconds=2.0)
    machine.busy = True
    busy = run(gov, machine, seconds=12.0)
    assert gov.current == 1 and gov.switches == 1
    assert busy[-20:] == [1] * 20  # within the first probe, and it stays
    machine.busy = False
    run(gov, machine, seconds=12.0)
    assert gov.current == 2 and gov.switches == 2


def test_long_steps_spend_at_most_the_probe_share_in_probes() -> None:
    machine = Machine()
    gov = ThreadGovernor(most=2, set_threads=machine.threads_set.append)  # 2%
    counts = run(gov, machine, seconds=600.0, rows=256)  # steps of 0.15 s at two threads
    probes = counts.count(1)
    assert 0 < probes <= 0.02 * len(counts), (probes, len(counts))


def test_long_steps_that_slow_down_are_probed_at_once() -> None:
    machine = Machine()
    gov = ThreadGovernor(most=2, set_threads=machine.threads_set.append)  # 2%
    run(gov, machine, seconds=20.0, rows=256)
    machine.busy = True  # a step now takes 1 s: the 2% rule alone would wait 150 s
    run(gov, machine, seconds=12.0, rows=256)
    assert gov.current == 1 and gov.switches == 1


def test_noise_within_the_margin_changes_nothing() -> None:
    calls: list[int] = []
    gov = ThreadGovernor(
        most=2, set_threads=calls.append, probe_every_s=0.0, probe_steps=2, probe_share=1.0
    )
    for per_row in (1.0, 1.0, 0.95, 0.95):  # the probe at one thread: 5% faster, under 15%
        gov.step_done(10, per_row * 10)
    assert gov.current == 2 and calls == [1, 2]


def test_the_thread_count_does_not_change_a_forward(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (8, 24), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out.append(model(ids).logits)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1])
