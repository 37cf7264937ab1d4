"""Rollout-only and replay runs (issue 49, item 2), with train.py and real processes.

A sync run with `logging.save_batches` stores each batch as trained; `--replay` of it, from
the same base model, with no engine at all, logs the same train losses and ends on the same
weights, bit for bit (here with the trainer in its own process, where the stored run trained in
the driver's). `--rollout-only` makes the batches with no trainer: every one by the base
weights, so only its first batch is the one a normal run trains (the normal run's later batches
are made by the weights each step moved); its replay trains that first batch as the normal
run's first step did.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollouts.config import DataConfig, load_config
from rollouts.data.arithmetic import prepare_addition_data
from rollouts.loop.batch_files import (
    BatchFileError,
    StoredBatch,
    check_replay,
    read_batch,
    step_dir,
    write_batch,
)
from rollouts.types import Sample, Status, TrainBatch
from tests.training.test_train_e2e import _config, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

REWARD = {"reward_fn": "tests.training.varied_reward.varied_reward"}  # nonzero advantages
# the engine's logprobs of the sampled tokens: equal tokens, floats of another batch shape
BATCH_FLOATS = ("train/logprob_mismatch",)
ROLLOUT_KEYS = ("reward/", "rollout/response_length", "rollout/groups_kept", "rollout/truncated")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_figures(row: dict, but: tuple[str, ...] = ()) -> dict:
    """A line's train/* figures but its seconds (and the keys `but`)."""
    return {
        k: v
        for k, v in row.items()
        if k.startswith("train/") and k not in but and not re.search(r"_s(_|$)", k)
    }


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    model = run / "checkpoints" / "rl" / f"step_{step:06d}" / "model" / "model.safetensors"
    return load_file(model)


def _run(work: Path, *flags: str, **sections: dict) -> Path:
    """train.py --mode rl in `work` (the tiny model, no held-out set, 3 steps unless said)."""
    work.mkdir(parents=True, exist_ok=True)
    paths = {k: str(work / f"data/{k[:-5]}.jsonl") for k in ("sft_path", "train_path", "eval_path")}
    prepare_addition_data(DataConfig(**paths))
    data = {"prepare": "", "eval_path": ""}  # no held-out set: no evaluation through the engines
    base = {"rollout": {"mode": "sync"} | REWARD, "data": data}
    config = _config(work, **(base | sections))
    done = _train("--mode", "rl", "--config", str(config), *flags)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (work / "console.txt").write_text(done.stdout)
    return work / "run"


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A normal sync run of 3 steps that stored its batches (the trainer in this process)."""
    work = tmp_path_factory.mktemp("stored")
    logging = {"rollouts_per_step": 100, "plots": False, "save_batches": True}
    return _run(work, training={"rl_steps": 3, "trainer_process": "off"}, logging=logging)


def test_a_replay_trains_to_the_same_losses_and_weights(stored: Path, tmp_path: Path) -> None:
    logging = {"rollouts_per_step": 100, "plots": False, "save_batches": True}
    training = {"rl_steps": 3, "trainer_process": "on"}
    base = {"path": str(stored.parent / "base")}  # the stored run's starting model
    replay = _run(tmp_path, "--replay", str(stored), training=training, logging=logging, model=base)
    a, b = _rows(stored), _rows(replay)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert any(r["train/grad_norm"] > 0.0 for r in a), a  # the steps did train
    for ra, rb in zip(a, b, strict=True):
        assert _train_figures(ra) == _train_figures(rb)  # == on floats: bit-equal
        assert "time/load_batch_s" in rb and "time/generate_s" not in rb, rb
        assert "time/sync_s" not in rb and "engines/load" not in rb, rb
        assert rb["time/save_batch_s"] < rb["perf/step_time_s"], rb
    wa, wb = _weights(stored, 3), _weights(replay, 3)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[name], wb[name]) for name in wa)
    assert not (replay / "engines").exists()  # no engine was started
    console = (tmp_path / "console.txt").read_text()
    assert "training in its own process" in console, console
    assert "the held-out evaluation is skipped" in console, console
    for step in (1, 2, 3):  # what each step trained on, as stored by both runs
        sa, sb = read_batch(stored / "batches", step), read_batch(replay / "batches", step)
        assert sa.groups == sb.groups
        assert sa.trained is not None and sb.trained is not None
        for field in ("input_ids", "loss_mask", "advantages"):
            pairs = zip(getattr(sa.trained, field), getattr(sb.trained, field), strict=True)
            assert all(torch.equal(x, y) for x, y in pairs), field


def _same_rollout_figures(a: dict, b: dict) -> None:
    for key, value in a.items():
        if key.startswith(ROLLOUT_KEYS):
            assert b[key] == value or (math.isnan(value) and math.isnan(b[key])), key


def test_rollout_only_then_replay(stored: Path, tmp_path: Path) -> None:
    """Rollout-only makes every batch with the base weights. Its first batch is a normal run's
    first (`stored`: made by the base weights too): the same rollout figures. Its later ones
    are what a normal run makes when no sync moves the engines (`weight_sync.every` past the
    last step, one checkpoint at the end, no evaluation): against such a run, every step's
    rollout figures, every train loss and the final weights are the same; against `stored`,
    whose batch 2 was made by version 1, they are not, as they must not be."""
    steps = {"rl_steps": 2}
    made = _run(tmp_path / "made", "--rollout-only", training=steps)
    rows = _rows(made)
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("train/") for r in rows for k in r), rows
    assert all(r["time/generate_s"] > 0.0 and "time/save_batch_s" in r for r in rows), rows
    assert not (made / "checkpoints").exists()
    _same_rollout_figures(rows[0], _rows(stored)[0])
    second = read_batch(made / "batches", 2)
    assert {v for g in second.groups for s in g for v in s.weight_versions} == {"0"}
    at_end = {"every": 0}  # one checkpoint, after the last batch
    base = {"path": str(tmp_path / "made" / "base")}
    replay = _run(
        tmp_path / "replay", "--replay", str(made), training=steps, checkpoint=at_end, model=base
    )
    unsynced = _run(
        tmp_path / "unsynced",
        training=steps,
        checkpoint=at_end,
        weight_sync={"every": 100},
        model=base,
    )
    trained, normal = _rows(replay), _rows(unsynced)
    assert [r["step"] for r in trained] == [r["step"] for r in normal] == [1, 2]
    for made_row, replayed, unsynced_row in zip(rows, trained, normal, strict=True):
        _same_rollout_figures(made_row, unsynced_row)
        _same_rollout_figures(unsynced_row, replayed)
        assert _train_figures(replayed, BATCH_FLOATS) == _train_figures(unsynced_row, BATCH_FLOATS)
    assert trained[1]["rollout/staleness_max"] == 1.0  # batch 2 was made by version 0
    wa, wb = _weights(replay, 2), _weights(unsynced, 2)
    assert all(torch.equal(wa[name], wb[name]) for name in wa)


def test_a_replay_that_does_not_fit_is_refused(stored: Path, tmp_path: Path) -> None:
    """Another batch size than the stored batches', or a step that is not stored: an error
    naming the file and the key, before anything is built."""
    config = load_config(str(stored.parent / "config.toml"))
    other = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, batch_size=3))
    with pytest.raises(BatchFileError, match=r"step_000001/batch.json: .*rollout.batch_size = 2"):
        check_replay(other, stored / "batches", 1, 3)
    with pytest.raises(BatchFileError, match=r"step_000004: missing .*training.rl_steps"):
        check_replay(config, stored / "batches", 1, 4)
    config_path = stored.parent / "config.toml"
    out = f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"
    done = _train(
        "--mode",
        "rl",
        "--config",
        str(config_path),
        "--replay",
        str(stored),
        "--set",
        "rollout.batch_size=3",
        "--set",
        out,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rollout.batch_size = 2" in done.stderr and "step_000001" in done.stderr, done.stderr
    done = _train("--mode", "sft+rl", "--config", str(config_path), "--replay", str(stored))
    assert done.returncode == 2 and "use --mode rl" in done.stderr, done.stderr


def test_a_stored_batch_reads_back_as_it_was(tmp_path: Path) -> None:
    """Every field of every sample (the engine's logprobs exactly, as float64), the rollout
    statistics and the TrainBatch as trained."""
    samples = [
        Sample(
            index=i,
            group_index=0,
            prompt=((({"role": "user", "content": "2+2?"}),) if i else "1+1="),
            label="4",
            tokens=(5, 6, 7, 8 + i),
            loss_mask=(0, 0, 1, 1),
            response_length=2,
            rollout_logprobs=(-0.1 / 3, -1e-300 * i),
            reward=(1.0, 0.5) if i else 0.25,
            status=Status.COMPLETED if i else Status.TRUNCATED,
            weight_versions=("3", "4"),
            metadata={"source": "a", "turns": [1, 2]},
            teacher_logprobs=(-0.5, -2.0) if i else (),
        )
        for i in range(2)
    ]
    trained = TrainBatch(
        input_ids=tuple(torch.tensor(s.tokens) for s in samples),
        loss_mask=tuple(torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples),
        advantages=(torch.tensor([0.0, 0.0, 0.5, 0.5]), torch.tensor([0.0, 0.0, -0.5, -0.5])),
        num_global_tokens=4.0,
        num_global_seqs=2.0,
        max_response_length=8,
    )
    batch = StoredBatch(
        step=3,
        number=4,
        version=2,
        groups=(tuple(samples),),
        metadata={"generated_tokens": 4, "failures": {"reward/non_finite": 1}},
        shape={"rollout.batch_size": 1},
        trained=trained,
    )
    write_batch(tmp_path, batch)
    write_batch(tmp_path, batch)  # a resumed run writes the step again: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]
    back = read_batch(tmp_path, 3)
    assert back.groups == batch.groups
    assert (back.step, back.number, back.version) == (3, 4, 2)
    assert back.metadata == batch.metadata and back.shape == batch.shape
    assert back.trained is not None
    assert back.trained.num_global_tokens == 4.0 and back.trained.max_response_length == 8
    for field in ("input_ids", "loss_mask", "advantages"):
        pairs = zip(getattr(back.trained, field), getattr(trained, field), strict=True)
        assert all(torch.equal(x, y) for x, y in pairs), field
    (step_dir(tmp_path, 3) / "batch.json").write_text("{")
    with pytest.raises(BatchFileError, match="step_000003: unreadable"):
        read_batch(tmp_path, 3)
