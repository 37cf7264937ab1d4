"""Which CPU cores the training thread, the built-in engines and the driver run on.

When the trainer and the built-in engines all run on this machine's CPU (`training.cpu_placement
= "auto"`, the default, and no torch thread count set by hand), the cores this process may use
are split as the torch thread shares are (`engines.cpu_share`): the first share for the training
thread and the torch threads it starts, the next share for each engine process.

In async mode the driver's thread (HTTP to the engines, rewards, batch building, the weight
file writer) runs on the engines' cores as well. Generation has slack there, while every slice
the driver takes on the training core - CPU time, and the GIL while the training thread runs
Python - lengthens the step that bounds async throughput. In sync mode the driver is left
unpinned: it works while the trainer waits. `scripts/bench_rl_step.py --set
training.cpu_placement="'off'"` measures without it. Pinning is Linux-only
(`os.sched_setaffinity`); elsewhere nothing is pinned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Collection, Iterator, Sequence

from rollouts.config import Config

PLACEMENTS = ("auto", "off")


@dataclasses.dataclass(frozen=True, slots=True)
class CpuPlan:
    """Cores per part; `driver` () = the driver thread is not pinned."""

    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    driver: tuple[int, ...]

    def describe(self) -> str:
        engines = ", ".join(_cores(c) for c in self.engines)
        driver = _cores(self.driver) if self.driver else "unpinned"
        return f"trainer {_cores(self.trainer)}; engines {engines}; driver {driver}"


def _cores(cores: Sequence[int]) -> str:
    return ",".join(map(str, cores))


def plan_cpus(cores: Collection[int], num_engines: int, *, pin_driver: bool) -> CpuPlan | None:
    """Equal shares of `cores` for the trainer and each engine (leftover cores: the driver's);
    None when there are fewer cores than parts."""
    assert num_engines >= 1, f"{num_engines=}"
    ordered = sorted(cores)
    share = len(ordered) // (num_engines + 1)
    if share < 1:
        return None
    trainer = tuple(ordered[:share])
    engines = tuple(tuple(ordered[share * (i + 1) : share * (i + 2)]) for i in range(num_engines))
    driver = tuple(c for c in ordered if c not in trainer) if pin_driver else ()
    return CpuPlan(trainer=trainer, engines=engines, driver=driver)


def cpu_plan(config: Config) -> CpuPlan | None:
    """The plan for an RL phase of `config` on this machine, or None (nothing pinned)."""
    t, e = config.training, config.engines
    if t.cpu_placement == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    if e.kind != "builtin" or e.device != "cpu" or t.backend != "pytorch":
        return None  # remote or GPU engines; FSDP ranks are placed by torchrun
    if t.torch_threads or e.torch_threads:
        return None  # thread counts set by hand: so is their placement
    from rollouts.trainer.factories import resolve_device

    if resolve_device(t.device).type != "cpu":
        return None
    cores = os.sched_getaffinity(0)
    return plan_cpus(cores, e.num_engines, pin_driver=config.rollout.mode == "async")


def wants_trainer_process(config: Config, plan: CpuPlan | None) -> bool:
    """Whether the RL phase trains in a child process (`backends/process.py`): "on" always (for
    the one-device backend), "auto" when async mode runs with a CPU `plan`: the driver then works
    beside the training step, and in one process its Python holds the GIL the training thread
    needs between torch ops."""
    t = config.training
    if t.trainer_process == "off" or t.backend != "pytorch":
        return False
    if t.trainer_process == "on":
        return True
    return plan is not None and config.rollout.mode == "async"


@contextlib.contextmanager
def pinned(cores: Collection[int]) -> Iterator[None]:
    """This process's threads that are not placed elsewhere (their mask is the process's own:
    the calling thread, trio's cached worker threads, ...) on `cores` for the block; threads
    they start meanwhile inherit it. A thread already pinned (the training thread) is left."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    moved = []
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, set(cores))
                moved.append(tid)
    try:
        yield
    finally:
        for tid in moved:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before)


def _threads() -> list[int]:
    """Native ids of this process's threads, the caller's first."""
    me = threading.get_native_id()
    try:
        others = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
    except OSError:  # no /proc: the calling thread only
        others = []
    return [me, *others]
