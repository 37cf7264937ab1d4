"""CPU placement: the training thread, each built-in engine and (async) the driver on their own
cores; the plan, the engine's --cpus flag, and a real async run whose threads are checked. And
the one decision of where training runs (this process or its own), with its reason."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollouts.config import config_from_dict
from rollouts.driver.metrics import read_jsonl_rows
from rollouts.driver.placement import (
    CpuPlan,
    colocate_cpus,
    cpu_plan,
    decide_trainer_process,
    placement_of,
    plan_cpus,
    why_unplaced,
)
from rollouts.driver.quick_start import quick_start_training
from rollouts.engine.launch import engine_process, engine_spec
from rollouts.forkserver import ENV_VAR
from rollouts.openmp import short_spin_waits
from rollouts.trainer.core import TrainerCore
from rollouts.types import Sample

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="placement needs >= 2 usable cores")


def test_equal_shares_for_the_trainer_and_each_engine() -> None:
    assert plan_cpus([0, 1], 1, pin_driver=True) == CpuPlan(
        trainer=(0,), engines=((1,),), driver=(1,)
    )
    assert plan_cpus([0, 1], 1, pin_driver=False) == CpuPlan(
        trainer=(0,), engines=((1,),), driver=()
    )
    # 7 cores, 2 engines: shares of 2; the leftover core is the driver's only
    plan = plan_cpus([6, 5, 4, 3, 2, 1, 0], 2, pin_driver=True)
    assert plan == CpuPlan(trainer=(0, 1), engines=((2, 3), (4, 5)), driver=(2, 3, 4, 5, 6))
    assert plan_cpus([0], 1, pin_driver=True) is None  # fewer cores than parts: no pinning


def test_colocated_every_part_gets_every_core_and_nothing_is_pinned() -> None:
    plan = colocate_cpus([0, 1, 2, 3], 2)
    assert plan.colocated and plan.trainer == () and plan.engines == ((), ()) and not plan.driver
    assert (plan.trainer_threads, plan.engine_threads) == (4, 2)  # two engines generate at once
    assert plan.describe().startswith("colocated: the trainer 4 threads, each engine 2")
    split = plan_cpus([0, 1], 1, pin_driver=True)
    assert split is not None and not split.colocated
    assert (split.trainer_threads, split.engine_threads) == (1, 1)


@pytest.mark.parametrize(
    ("mode", "placement", "chosen"),
    [
        ("sync", "auto", "colocate"),
        ("async", "auto", "split"),
        ("sync", "colocate", "colocate"),
        ("sync", "split", "split"),
        ("async", "colocate", "colocate"),
    ],
)
def test_auto_colocates_in_sync_mode_and_splits_in_async_mode(
    mode: str, placement: str, chosen: str
) -> None:
    config = config_from_dict(
        {"rollout": {"mode": mode}, "training": {"device": "cpu", "cpu_placement": placement}}
    )
    assert placement_of(config) == chosen
    plan = cpu_plan(config)
    if plan is not None:
        assert plan.colocated == (chosen == "colocate")


def _config(**training: Any) -> Any:
    return config_from_dict(
        {
            "model": {"path": "unused"},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {"mode": "async"},
            "training": {"device": "cpu", **training},
        },
        "test",
    )


@needs_two_cores
def test_the_plan_applies_only_to_cpu_runs_left_to_the_defaults() -> None:
    assert cpu_plan(_config()) == plan_cpus(CORES, 1, pin_driver=True)
    sync = config_from_dict(
        {"model": {"path": "unused"}, "data": {"train_path": "unused.jsonl"}}, "test"
    )
    assert cpu_plan(sync) in (None, colocate_cpus(CORES, 1))  # device auto; sync: colocated
    assert cpu_plan(_config(cpu_placement="off")) is None
    assert cpu_plan(_config(torch_threads=2)) is None  # set by hand: placed by hand
    assert cpu_plan(_config(backend="fsdp")) is None


def test_a_bad_placement_value_names_the_key() -> None:
    with pytest.raises(ValueError, match="training.cpu_placement"):
        _config(cpu_placement="pinned")


PLAN = CpuPlan(trainer=(0,), engines=((1,),), driver=(1,))
AUTO = "(training.trainer_process = 'auto')"
OFF = {"cpu_placement": "off"}
DECISIONS = [  # rollout.mode, [training], the CPU plan, a caller's backend -> own process, why
    (
        "sync",
        {},
        PLAN,
        False,
        False,
        f"rollout.mode = 'sync': the step trains while the driver waits {AUTO}",
    ),
    (
        "async",
        {},
        PLAN,
        False,
        True,
        f"async with CPU placement: the driver's Python stays off the trainer's GIL {AUTO}",
    ),
    (
        "async",
        OFF,
        None,
        False,
        False,
        f"async, but no CPU placement: training.cpu_placement = 'off' {AUTO}",
    ),
    ("async", {"trainer_process": "on"}, None, False, True, "training.trainer_process = 'on'"),
    ("sync", {"trainer_process": "on"}, None, False, True, "training.trainer_process = 'on'"),
    ("async", {"trainer_process": "off"}, PLAN, False, False, "training.trainer_process = 'off'"),
    (
        "async",
        {"backend": "fsdp"},
        None,
        False,
        False,
        "training.backend = 'fsdp': rank 0 of torchrun's",
    ),
    ("async", {}, PLAN, True, False, "the caller builds the backend (make_backend)"),
]


@pytest.mark.parametrize(("mode", "training", "plan", "custom", "own", "reason"), DECISIONS)
def test_where_training_runs_is_one_decision_with_its_reason(
    mode: str, training: dict, plan: CpuPlan | None, custom: bool, own: bool, reason: str
) -> None:
    config = config_from_dict({"rollout": {"mode": mode}, "training": training})
    decision = decide_trainer_process(config, plan, custom_backend=custom)
    assert (decision.own_process, decision.reason) == (own, reason)
    where = "in its own process (pid 7)" if own else "in this process"
    assert decision.describe(7 if own else None) == f"training {where}: {reason}"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning is Linux-only")
def test_no_placement_names_the_key_that_turned_it_off() -> None:
    def why(**sections: dict) -> str:
        return why_unplaced(config_from_dict({"training": {"device": "cpu"}} | sections))

    assert why(training={"cpu_placement": "off"}) == "training.cpu_placement = 'off'"
    sglang = {"kind": "sglang", "urls": ["http://a:1"]}
    assert why(engines=sglang).startswith("engines.kind = 'sglang'")
    assert why(engines={"builtin": {"device": "cuda:1"}}) == "engines.builtin.device = 'cuda:1'"
    assert why(training={"device": "cpu", "torch_threads": 2}).startswith("torch threads set")
    assert why(training={"device": "cpu", "backend": "fsdp"}).startswith("training.backend")
    colocate = {"training": {"device": "cpu", "cpu_placement": "colocate"}}
    assert why(**colocate) == ""  # colocated: one core is enough
    assert why() == (
        "" if len(CORES) >= 2 else f"{len(CORES)} core(s) for the trainer and 1 engine(s)"
    )
    assert (why() == "") == (
        cpu_plan(config_from_dict({"training": {"device": "cpu"}})) is not None
    )


def test_bad_trainer_process_values_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"training.trainer_process = 'always': must be one of"):
        config_from_dict({"training": {"trainer_process": "always"}})
    with pytest.raises(ValueError, match="training.trainer_process = 'on' needs"):
        config_from_dict({"training": {"trainer_process": "on", "backend": "fsdp"}})


@needs_two_cores
async def test_an_engine_started_with_cpus_runs_only_there(tiny_model_dir: Path) -> None:
    core = CORES[-1]
    async with engine_process(tiny_model_dir, torch_threads=1, cpus=(core,)) as proc:
        threads = os.listdir(f"/proc/{proc.process.pid}/task")
        assert len(threads) > 1  # the server's own threads inherit the mask too
        for tid in threads:
            assert os.sched_getaffinity(int(tid)) == {core}, tid


def test_a_bad_cpus_flag_is_refused_with_its_name(tiny_model_dir: Path) -> None:
    spec = engine_spec(tiny_model_dir)
    for bad, says in (("1;2", "comma-separated"), ("4096", "may only use cores")):
        cmd = [sys.executable, "-m", "rollouts.engine", "--model", spec.options.model]
        out = subprocess.run(
            [*cmd, "--cpus", bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out
        assert "--cpus" in out.stderr and says in out.stderr, out.stderr


def _child_pids(module: bytes = b"rollouts.engine") -> list[int]:
    """This process's children running `module` (engines by default)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if module in cmd and parent == os.getpid():
            pids.append(int(entry))
    return pids


@needs_two_cores
@pytest.mark.parametrize("trainer_process", ["off", "auto"])
def test_an_async_run_keeps_training_driver_and_engine_apart(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer_process: str
) -> None:
    """ "off": the training thread of this process; "auto": the trainer process's threads (its
    training thread on the trainer's cores, its socket reader and weight writer on the driver's)."""
    seen: dict[str, set[frozenset[int]]] = {k: set() for k in ("train", "driver", "engine")}
    monkeypatch.delenv(ENV_VAR, raising=False)  # the run's engines: this process's children
    others = set(_child_pids())  # engines of module-scoped fixtures: not this run's
    real_fb = TrainerCore.forward_backward

    def recording_fb(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["train"].add(frozenset(os.sched_getaffinity(0)))
        return real_fb(self, *args, **kwargs)

    def reward(sample: Sample) -> float:
        seen["driver"].add(frozenset(os.sched_getaffinity(0)))  # a driver worker thread
        for pid in set(_child_pids()) - others:
            seen["engine"].add(frozenset(os.sched_getaffinity(pid)))
        for pid in _child_pids(b"rollouts.trainer.process_child"):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):  # a thread that just ended
                    seen["train"].add(frozenset(os.sched_getaffinity(int(tid))))
        return float(sample.response_length % 2)

    monkeypatch.setattr(TrainerCore, "forward_backward", recording_fb)
    quick_start_training(
        tiny_model_dir,
        [f"{a}+{a}=" for a in range(10, 20)],
        reward,
        num_iterations=3,
        output_dir=tmp_path / "run",
        overrides={
            "rollout": {"mode": "async", "sampling": {"max_new_tokens": 8}},
            "training": {"trainer_process": trainer_process},
            "logging": {"console": False},
        },
    )
    plan = plan_cpus(CORES, 1, pin_driver=True)
    assert plan is not None
    rows = read_jsonl_rows(tmp_path / "run" / "metrics.jsonl")
    has_trainer_rss = ["perf/trainer_rss_mb" in row for row in rows if row["step"] > 0]
    assert has_trainer_rss == [trainer_process == "auto"] * 3  # the trainer process's memory
    if trainer_process == "off":
        assert seen["train"] == {frozenset(plan.trainer)}
    else:  # the child's threads: the training thread and the others, apart (start-up work,
        # which may still run when the first rewards come, uses every core)
        assert {frozenset(plan.trainer), frozenset(plan.driver)} <= seen["train"], seen
        assert seen["train"] <= {frozenset(plan.trainer), frozenset(plan.driver), frozenset(CORES)}
    assert seen["engine"], "the run's engine process was not found"
    assert seen["engine"] == {frozenset(plan.engines[0])}
    assert seen["driver"] and all(s <= frozenset(plan.driver) for s in seen["driver"]), seen
    assert os.sched_getaffinity(0) == set(CORES)  # the caller's thread is given back its cores


@needs_two_cores
def test_a_colocated_sync_run_gives_each_phase_every_core(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Colocated (`training.cpu_placement = "colocate"`): the trainer trains on every core's
    worth of threads, the engine is not pinned and runs as many torch threads (one engine)."""
    import torch

    seen: dict[str, set] = {"train_threads": set(), "train_cores": set(), "engine": set()}
    monkeypatch.delenv(ENV_VAR, raising=False)  # the run's engines: this process's children
    others = set(_child_pids())  # engines of module-scoped fixtures: not this run's
    real_fb = TrainerCore.forward_backward

    def recording_fb(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["train_threads"].add(torch.get_num_threads())
        seen["train_cores"].add(frozenset(os.sched_getaffinity(0)))
        return real_fb(self, *args, **kwargs)

    def reward(sample: Sample) -> float:
        for pid in set(_child_pids()) - others:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--torch-threads" in cmd:
                threads = int(cmd[cmd.index(b"--torch-threads") + 1])
                seen["engine"].add((frozenset(os.sched_getaffinity(pid)), threads))
        return float(sample.response_length % 2)

    monkeypatch.setattr(TrainerCore, "forward_backward", recording_fb)
    quick_start_training(
        tiny_model_dir,
        [f"{a}+{a}=" for a in range(10, 20)],
        reward,
        num_iterations=2,
        output_dir=tmp_path / "run",
        overrides={
            "rollout": {"mode": "sync", "sampling": {"max_new_tokens": 8}},
            "training": {"cpu_placement": "colocate"},
            "logging": {"console": False},
        },
    )
    assert seen["train_threads"] == {len(CORES)}
    assert seen["train_cores"] == {frozenset(CORES)}
    assert seen["engine"] == {(frozenset(CORES), len(CORES))}, seen


def test_openmp_waits_spin_briefly_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    short_spin_waits(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    short_spin_waits(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "0"}
    short_spin_waits(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    code = (  # the front door sets it before torch loads (not run as __main__: no training)
        "import os, runpy; runpy.run_path('integration_training/train.py'); "
        "print(os.environ['GOMP_SPINCOUNT'], os.environ['OMP_WAIT_POLICY'])"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert done.stdout.strip().endswith("30000 PASSIVE"), done.stdout + done.stderr
