"""Which CPU cores, and how many torch threads, the trainer, the built-in engines and the driver
get in the RL phase.

When the trainer and the built-in engines all run on this machine's CPU (`training.cpu_placement`
not "off", and no torch thread count set by hand), there are two plans; "auto" colocates in sync
mode and splits in async mode:
- colocate (sync mode): generation and training alternate, so each phase gets the whole machine:
  the trainer (SFT too) runs every core's worth of torch threads, each engine its share of every
  core, nothing is pinned; the side that waits holds no core (an idle engine blocks on its queue;
  OpenMP threads that wait spin about 0.3 ms, then sleep: `rollouts/openmp.py` sets
  `OMP_WAIT_POLICY=PASSIVE` and `GOMP_SPINCOUNT=30000` unless the user set the policy).
- split (async mode, where generation and training overlap): the cores are split as equal
  shares: the first for the training thread and the torch threads it starts, the next for each
  engine process (pinned, `rollouts serve --cpus`). The driver's thread (HTTP to the engines,
  rewards, batch building, the weight-file writer) runs on the engines' cores as well:
  generation has slack there, while every slice the driver takes on the training core - CPU
  time, and the GIL while the training thread runs Python - lengthens the step that bounds async
  throughput. In sync mode (asked for with "split") the driver is left unpinned.
Measured on the 2-core box (passive waits; `scripts/bench_rl_step.py --modes
floor,sync,async,sync-split --set training.cpu_placement=colocate`): the tiny model's sync step
1.50 s colocated against 1.70 s split; SmolLM2 (bf16 autocast, 4 steps) 58.6 s against 73.5 s,
and 113.6 s against 132.3 s beside two busy processes. With libgomp's spinning waits colocation
collapsed under outside load (28 s against 2.7 s a step), which is why waits spin only briefly
(`rollouts/openmp.py`: 1.07 s colocated on the quiet box, 2.84 s beside two busy processes).
Pinning is Linux-only (`os.sched_setaffinity`); elsewhere nothing is pinned.

Whether the RL phase trains in a child process is decided here too, in one function
(`decide_trainer_process`) that returns the decision with its reason; the driver prints both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from collections.abc import Collection, Iterator, Sequence

from rollouts.config import Config
from rollouts.engine_kinds import engine_kind

CAN_PIN = sys.platform == "linux"  # os.sched_setaffinity: Linux only


@dataclasses.dataclass(frozen=True, slots=True)
class CpuPlan:
    """Cores and torch threads per part; () = not pinned (any core)."""

    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    driver: tuple[int, ...]
    trainer_threads: int = 0  # 0: len(trainer)
    engine_threads: int = 0  # each engine's; 0: the size of its core set

    def __post_init__(self) -> None:
        if not self.trainer_threads:
            object.__setattr__(self, "trainer_threads", len(self.trainer))
        if not self.engine_threads and self.engines:
            object.__setattr__(self, "engine_threads", len(self.engines[0]))
        assert self.trainer_threads >= 1 and self.engine_threads >= 1, f"{self}"

    @property
    def colocated(self) -> bool:
        return not self.trainer

    def describe(self) -> str:
        if self.colocated:
            return (
                f"colocated: the trainer {self.trainer_threads} threads, each engine "
                f"{self.engine_threads}, on every core (the phases alternate)"
            )
        engines = ", ".join(_cores(c) for c in self.engines)
        driver = _cores(self.driver) if self.driver else "unpinned"
        return f"split: trainer {_cores(self.trainer)}; engines {engines}; driver {driver}"


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


def colocate_cpus(cores: Collection[int], num_engines: int) -> CpuPlan:
    """Every core for the trainer; each engine an equal share of every core (the engines
    generate at once); nothing pinned."""
    assert num_engines >= 1, f"{num_engines=}"
    n = len(cores)
    return CpuPlan(
        trainer=(),
        engines=((),) * num_engines,
        driver=(),
        trainer_threads=n,
        engine_threads=max(1, n // num_engines),
    )


def why_unplaced(config: Config) -> str:
    """Why an RL phase of `config` pins nothing on this machine (naming the key or the fact);
    "" when it pins (`cpu_plan`)."""
    t, e = config.training, config.engines
    if t.cpu_placement == "off":
        return "training.cpu_placement = 'off'"
    if not CAN_PIN:
        return "this OS cannot pin threads"
    if not engine_kind(e.kind).started_here:
        return f"engines.kind = {e.kind!r} (servers of their own)"
    if e.builtin.device != "cpu":
        return f"engines.builtin.device = {e.builtin.device!r}"
    if t.backend != "pytorch":
        return f"training.backend = {t.backend!r} (torchrun places the ranks)"
    if t.torch_threads or e.builtin.torch_threads:
        return "torch threads set by hand (training.torch_threads, engines.builtin.torch_threads)"
    from rollouts.trainer.factories import resolve_device

    device = resolve_device(t.device)
    if device.type != "cpu":
        return f"the trainer is on {device} (training.device = {t.device!r})"
    cores = len(os.sched_getaffinity(0))
    if placement_of(config) == "split" and cores < e.builtin.num_engines + 1:
        return f"{cores} core(s) for the trainer and {e.builtin.num_engines} engine(s)"
    return ""


def cpu_plan(config: Config) -> CpuPlan | None:
    """The plan for an RL phase of `config` on this machine, or None (nothing pinned)."""
    if why_unplaced(config):
        return None
    cores = os.sched_getaffinity(0)
    n = config.engines.builtin.num_engines
    if placement_of(config) == "colocate":
        return colocate_cpus(cores, n)
    return plan_cpus(cores, n, pin_driver=config.rollout.mode == "async")


def placement_of(config: Config) -> str:
    """ "colocate" or "split": `training.cpu_placement`; "auto" colocates in sync mode (the phases
    alternate) and splits in async mode (they overlap)."""
    chosen = config.training.cpu_placement
    if chosen != "auto":
        return chosen
    return "colocate" if config.rollout.mode == "sync" else "split"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerProcessDecision:
    """Whether the RL phase trains in a child process (`trainer/process.py`), and why."""

    own_process: bool
    reason: str  # names the key (or the fact) that decided

    def __post_init__(self) -> None:
        assert self.reason, "a decision without its reason"

    def describe(self, pid: int | None = None) -> str:
        """The line the driver prints at start."""
        where = "in its own process" if self.own_process else "in this process"
        return f"training {where}{f' (pid {pid})' if pid is not None else ''}: {self.reason}"


def decide_trainer_process(
    config: Config, plan: CpuPlan | None, *, custom_backend: bool = False
) -> TrainerProcessDecision:
    """The one place that decides where the RL phase trains: `training.trainer_process` "on"
    (one-device backend) or "off" as set; "auto" trains in a child process only in async mode
    with a CPU `plan` (`cpu_plan`): the driver then works beside the training step, and in one
    process its Python holds the GIL the training thread needs between torch ops. A caller's own
    backend factory (`custom_backend`) and FSDP (torchrun's ranks) train where they are."""
    t = config.training
    if t.backend != "pytorch":
        return _decision(False, f"training.backend = {t.backend!r}: rank 0 of torchrun's")
    if custom_backend:
        return _decision(False, "the caller builds the backend (make_backend)")
    if t.trainer_process != "auto":
        return _decision(
            t.trainer_process == "on", f"training.trainer_process = {t.trainer_process!r}"
        )
    auto = "(training.trainer_process = 'auto')"
    if config.rollout.mode != "async":
        return _decision(
            False, f"rollout.mode = 'sync': the step trains while the driver waits {auto}"
        )
    if plan is None:
        why = why_unplaced(config) or "no cores to pin"
        return _decision(False, f"async, but no CPU placement: {why} {auto}")
    return _decision(
        True, f"async with CPU placement: the driver's Python stays off the trainer's GIL {auto}"
    )


def _decision(own_process: bool, reason: str) -> TrainerProcessDecision:
    return TrainerProcessDecision(own_process=own_process, reason=reason)


@contextlib.contextmanager
def pinned(cores: Collection[int]) -> Iterator[None]:
    """This process's threads that are not placed elsewhere (their mask is the process's own:
    the calling thread, trio's cached worker threads, ...) on `cores` for the block; threads
    they start meanwhile inherit it. A thread already pinned (the training thread) is left."""
    if not cores or not CAN_PIN:
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
