"""train.py end to end, as a user runs it: real processes, real engines, real checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollouts.config import DataConfig
from rollouts.data.arithmetic import prepare_addition_data
from rollouts.data.buffer import DataBuffer, MixtureSource
from rollouts.data.loaders import load_prompts, write_jsonl
from tests import programs
from tests.toml_config import write_config
from tests.training.conftest import FinishedRun

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "integration_training" / "train.py"


PATHS = ("sft_path", "train_path", "eval_path")


def _config(tmp: Path, **sections: dict) -> Path:
    base = {
        "run": {"output_dir": str(tmp / "run"), "seed": 0},
        "model": {"path": str(tmp / "base")},
        "model.tiny": {
            "enabled": True,
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 128,
        },
        "data": {
            "prepare": "rollouts.data.arithmetic.prepare_addition_data",
            "sft_path": str(tmp / "data/sft.jsonl"),
            "train_path": str(tmp / "data/train.jsonl"),
            "eval_path": str(tmp / "data/eval.jsonl"),
            "eval_size": 8,
        },
        "training": {
            "sft_steps": 6,
            "sft_batch_size": 8,
            "sft_lr": 3e-3,
            "rl_steps": 3,
            "micro_batch_tokens": 4096,
        },
        "optim": {"lr": 1e-4, "scheduler": "constant"},
        "rollout": {
            "batch_size": 2,
            "n_samples_per_prompt": 2,
            "over_sampling_factor": 1.0,
            "reward_fn": "rollouts.rewards.verifiers.exact_match_reward",
        },
        "rollout.sampling": {"max_new_tokens": 8},
        "engines.builtin": {"max_batch": 16},
        "checkpoint": {"every": 1, "keep_last": 2},
        # plots off: a second of CPU a run; test_real_model checks the driver writes them
        "logging": {"rollouts_per_step": 100, "plots": False},
    }
    return write_config(tmp / "config.toml", base, sections)


def _train(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return programs.run([sys.executable, TRAIN, *args], timeout=timeout_s, cwd=ROOT)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[rollout]\nbatch_sise = 2\n")
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode == 2
    assert "did you mean 'rollout.batch_size'" in done.stderr


def _mixture(tmp: Path, config: Path) -> list[MixtureSource]:
    """The demo's prompts as two sources: "a", JSONL, with the held-out set; "b", parquet,
    the other half, at twice the weight. Appended to `config` as [[data.sources]]."""
    prepare_addition_data(DataConfig(**{k: str(tmp / f"data/{k[:-5]}.jsonl") for k in PATHS}))
    rows = [json.loads(line) for line in (tmp / "data/train.jsonl").read_text().splitlines()]
    half = len(rows) // 2
    write_jsonl(tmp / "data/a.jsonl", rows[:half])
    pq.write_table(pa.Table.from_pylist(rows[half:]), tmp / "data/b.parquet")
    text = config.read_text().replace(f'train_path = "{tmp / "data/train.jsonl"}"\n', "")
    text = text.replace(f'eval_path = "{tmp / "data/eval.jsonl"}"\n', "")
    text = text.replace('prepare = "rollouts.data.arithmetic.prepare_addition_data"\n', "")
    text += f'[[data.sources]]\nname = "a"\npath = "{tmp / "data/a.jsonl"}"\n'
    text += f'eval_path = "{tmp / "data/eval.jsonl"}"\n'
    text += f'[[data.sources]]\nname = "b"\npath = "{tmp / "data/b.parquet"}"\nweight = 2.0\n'
    config.write_text(text)
    a = load_prompts(tmp / "data/a.jsonl", source="a")
    b = load_prompts(tmp / "data/b.parquet", source="b", first_index=len(a))
    return [
        MixtureSource(name="a", items=tuple(a), weight=1.0),
        MixtureSource(name="b", items=tuple(b), weight=2.0),
    ]


def _expected_order(tmp: Path, steps: int, batch_size: int) -> list[list[int]]:
    buffer = DataBuffer(load_prompts(tmp / "data/train.jsonl"), seed=0)
    return [sorted(g[0].index for g in buffer.get_groups(batch_size, 1)) for _ in range(steps)]


def _order(rollouts: Path) -> dict[int, list[int]]:
    by_step: dict[int, set[int]] = {}
    for line in rollouts.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], set()).add(row["index"])
    return {step: sorted(idx) for step, idx in by_step.items()}


def _expected_mixture_order(
    sources: list[MixtureSource], steps: int, batch_size: int
) -> list[list[str]]:
    """Each step's prompts (source and row) as an unbroken run draws them."""
    buffer = DataBuffer.mixture(sources, seed=0)
    groups = [buffer.get_groups(batch_size, 1) for _ in range(steps)]
    return [sorted(_named(g[0].metadata["source"], g[0].prompt) for g in step) for step in groups]


def _named(source: str, prompt: object) -> str:
    return f"{source}: {json.dumps(list(prompt) if isinstance(prompt, tuple) else prompt)}"


def _mixture_order(rollouts: Path) -> dict[int, list[str]]:
    by_step: dict[int, set[str]] = {}
    for line in rollouts.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], set()).add(_named(row["source"], row["prompt"]))
    return {step: sorted(names) for step, names in by_step.items()}


def test_sigkill_mid_run_then_resume_continues_exactly(tmp_path: Path) -> None:
    """A mixture of a JSONL and a parquet source, graded by math-verify (issue 48): after a
    SIGKILL and --resume, every step trained the prompts an unbroken run draws, and each step
    logs its sources."""
    config = _config(tmp_path, training={"rl_steps": 6}, rollout={"reward_fn": "math"})
    sources = _mixture(tmp_path, config)
    run = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN), "--mode", "sft+rl", "--config", str(config)]
    proc = programs.popen(
        cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(_steps(metrics)) >= 4:  # eval row + 3 steps
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its engine processes, no clean-up
        proc.wait()
    killed_at = _steps(run / "metrics.jsonl")[-1]
    assert 3 <= killed_at < 6
    done = _train("--mode", "sft+rl", "--config", str(config), "--resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3, 4, 5, 6]  # no duplicate, no gap
    order = _mixture_order(run / "rollouts.jsonl")
    assert [order[s] for s in range(1, 7)] == _expected_mixture_order(sources, 6, 2)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[6]["source/a/drawn"] + rows[6]["source/b/drawn"] == 12.0, rows[6]
    drawn = sum(rows[6][f"source/{n}/samples"] for n in "ab" if f"source/{n}/samples" in rows[6])
    assert drawn == 4.0, rows[6]  # 2 prompts x 2 samples, by source
    assert "eval/a/accuracy" in rows[0] and "eval/b/accuracy" not in rows[0], rows[0]
    assert all(r.get("rollout/reward_failed", 0.0) == 0.0 for r in rows[1:]), rows
    assert rows[0]["eval/a/scored"] == 8.0 and rows[0]["eval/failed"] == 0.0, rows[0]  # graded


def test_rl_only_from_a_model_directory(tmp_path: Path) -> None:
    config = _config(tmp_path, training={"rl_steps": 2})
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [0, 1, 2]


def test_nproc_2_relaunches_under_torchrun_and_matches_one_process(tmp_path: Path) -> None:
    """--nproc 2: rank 0 drives, rank 1 mirrors its FSDP calls; SFT losses match one process;
    weights reach the engine over torch.distributed (rank 0 hosts the group under torchrun)."""
    losses = {}
    for nproc in (1, 2):
        work = tmp_path / f"n{nproc}"
        work.mkdir()
        config = _config(
            work, training={"sft_steps": 3, "rl_steps": 1}, weight_sync={"method": "distributed"}
        )
        done = _train("--mode", "sft+rl", "--config", str(config), "--nproc", str(nproc))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = (work / "run" / "sft_metrics.jsonl").read_text().splitlines()
        losses[nproc] = [r["sft/loss"] for r in map(json.loads, rows) if "sft/loss" in r]
        assert _steps(work / "run" / "metrics.jsonl") == [0, 1]
        synced = json.loads((work / "run" / "metrics.jsonl").read_text().splitlines()[1])
        assert synced["sync/failed_engines"] == 0.0 and synced["sync/buckets"] >= 1  # over gloo
        assert synced["sync/content_gap_max"] < 1e-4  # the engine serves the FSDP trainer's
    assert "re-launching under torchrun" in done.stdout
    assert losses[2] == pytest.approx(losses[1], rel=1e-4)


def test_sft_then_rl_end_to_end(finished_run: FinishedRun) -> None:
    """Last in this file: the other tests run first, so when test_resume_verify's worker builds
    the shared run (tests/training/conftest.py) this worker rarely waits on it."""
    done, run = finished_run.done, finished_run.run
    assert _steps(run / "sft_metrics.jsonl") == [0, 1, 2, 3, 4, 5, 6]  # 0 = held-out eval
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]  # 0 = held-out eval before RL
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in (
        "reward/mean",
        "eval/accuracy",
        "train/clipfrac",
        "train/logprob_mismatch",
        "time/generate_s",
        "time/train_s",
        "time/sync_s",
        "policy/version",
        "perf/driver_rss_mb",
    ):
        assert key in last, key
    assert last["policy/version"] == 3.0
    assert "held-out accuracy before RL" in done.stdout
    assert "held-out accuracy after RL" in done.stdout
    assert "plots:      none (logging.plots = false; `rollouts plot" in done.stdout
    assert not (run / "plots").exists()
    rl_root = run / "checkpoints" / "rl"
    ckpts = sorted(p.name for p in rl_root.iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_000002", "step_000003"]  # keep_last = 2
    best = json.loads((rl_root / "best.json").read_text())  # eval/accuracy ran at step 3 only
    assert "step_000003" in json.dumps(best)
    assert (run / "checkpoints" / "rl" / "step_000003" / "model" / "config.json").is_file()
    assert json.loads((run / "config.json").read_text())["config"]["rollout"]["batch_size"] == 2
    rows = (run / "rollouts.jsonl").read_text().splitlines()
    assert len(rows) == 3 * 2 * 2
    held = [json.loads(r) for r in (run / "eval_rollouts.jsonl").read_text().splitlines()]
    n = int(last["eval/scored"] + last["eval/failed"])
    assert [r["step"] for r in held] == [0] * n + [3] * n  # every episode of both evaluations
    assert sum(r["reward"] >= 1.0 for r in held[n:]) / n == pytest.approx(last["eval/accuracy"])
