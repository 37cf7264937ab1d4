"""The trainer process (`trainer/process.py`): the same numbers as training in this process,
weight snapshots written there, checkpoints that carry its RNG, errors with the child's
traceback, and a real kill that fails every call with the child's pid and exit code."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.process import TrainerProcess, TrainerProcessError
from rollouts.trainer.process_child import RNG_FILE
from rollouts.trainer.process_wire import pack, unpack
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.pytorch import load_hf_weights
from rollouts.trainer.remote import to_score
from rollouts.types import OPTIONAL_SEQUENCE_FIELDS
from tests.training.backend_helpers import (
    LENGTHS,
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py


@pytest.fixture
def host() -> Iterator[TrainerProcess]:
    trainer = TrainerProcess(threads=1)
    yield trainer
    trainer.close()


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_batch_crosses_the_socket_packed_and_comes_back_equal() -> None:
    batch = make_batch(LENGTHS)
    batch = type(batch)(**{**{f: getattr(batch, f) for f in batch.__slots__}, "metadata": {"k": 1}})
    fields = batch.__reduce__()[1][0]  # what pickling it writes: each tuple one buffer
    assert type(fields["input_ids"]).__name__ == "Ragged" and fields["metadata"] == {"k": 1}
    back = unpack(pickle.loads(pickle.dumps(pack(batch), protocol=5)))
    assert len(back) == len(batch) and back.metadata == {"k": 1}
    for a, b in zip(batch.input_ids, back.input_ids, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert back.num_global_tokens == batch.num_global_tokens
    assert unpack(pack(())) == ()  # an empty field stays empty


def test_tensors_of_every_dtype_cross_as_bytes_and_come_back_equal() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64):
        sent = (torch.arange(5).to(dtype), torch.zeros(0, dtype=dtype), torch.ones(3, dtype=dtype))
        back = unpack(pickle.loads(pickle.dumps(pack(sent), protocol=5)))
        assert all(torch.equal(a, b) and b.dtype == dtype for a, b in zip(sent, back, strict=True))
        back[0].zero_()  # writable: its own memory
    grad = (torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True))
    assert unpack(pickle.loads(pickle.dumps(pack(grad))))[0].requires_grad


TRAINING_ONLY = ("advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def test_a_batch_to_score_keeps_what_scoring_reads() -> None:
    batch = make_batch(LENGTHS)
    ones = tuple(torch.ones(len(t)) for t in batch.input_ids)
    full = dataclasses.replace(batch, metadata={"k": 1}, **dict.fromkeys(TRAINING_ONLY, ones))
    sent = to_score(full)
    assert all(getattr(sent, name) == () for name in OPTIONAL_SEQUENCE_FIELDS)
    assert sent.input_ids is full.input_ids and sent.loss_mask is full.loss_mask
    assert sent.metadata == {"k": 1} and sent.num_global_tokens == full.num_global_tokens


def test_the_trainer_process_trains_like_this_process(
    tiny_model_dir: Path, host: TrainerProcess
) -> None:
    config = tiny_config(tiny_model_dir, micro_batch_tokens=24)
    local = create_pytorch_backend(config, total_steps=10)
    remote = host.create(config, total_steps=10)
    assert isinstance(remote, TrainingBackend)
    assert remote.get_weights().keys() == local.get_weights().keys()
    batch = make_batch(LENGTHS)
    for _ in range(3):
        fb_local = local.forward_backward(batch, nll_loss).result()
        fb_remote = remote.forward_backward(batch, nll_loss).result()
        assert fb_remote["loss"] == fb_local["loss"]
        assert fb_remote["num_micro_batches"] == fb_local["num_micro_batches"] > 1
        opt_local, opt_remote = local.optim_step().result(), remote.optim_step().result()
        assert opt_remote["grad_norm"] == opt_local["grad_norm"] > 0
    logprobs_local = local.compute_logprobs(batch).result()
    # the training-only fields stay on this side (`remote.to_score`): the same logprobs
    full = dataclasses.replace(
        batch,
        **{name: tuple(torch.ones(len(t)) for t in batch.input_ids) for name in TRAINING_ONLY},
    )
    logprobs_remote = remote.compute_logprobs(full).result()
    assert len(logprobs_remote) == len(LENGTHS)
    assert all(torch.equal(a, b) for a, b in zip(logprobs_local, logprobs_remote, strict=True))
    assert _same_weights(local.get_weights(), remote.get_weights())
    local.close()
    remote.close()


def test_a_snapshot_is_written_as_it_was_while_training_goes_on(
    tiny_model_dir: Path, host: TrainerProcess, tmp_path: Path
) -> None:
    remote = host.create(tiny_config(tiny_model_dir), total_steps=10)
    batch = make_batch(LENGTHS)
    remote.forward_backward(batch, nll_loss)
    remote.optim_step()
    snapshot = remote.snapshot_weights()  # in order after that step
    at_snapshot = remote.get_weights()
    remote.forward_backward(batch, nll_loss)
    remote.optim_step().result()  # the model moves on before the files are written
    remote.write_weights(snapshot, tmp_path / "v_1")
    files = load_hf_weights(tmp_path / "v_1")
    assert (tmp_path / "v_1" / "config.json").is_file()
    assert _same_weights(files, {k: at_snapshot[k] for k in files})
    now = remote.get_weights()
    assert any(not torch.equal(files[k], now[k]) for k in files)  # the check can fail


def test_a_checkpoint_restores_the_model_the_optimizer_and_the_rng(
    tiny_model_dir: Path, host: TrainerProcess, tmp_path: Path
) -> None:
    config = tiny_config(tiny_model_dir)
    first = host.create(config, total_steps=10)
    batch = make_batch(LENGTHS)
    first.forward_backward(batch, nll_loss)
    first.optim_step().result()
    first.save_checkpoint(tmp_path / "ckpt").result()
    assert (tmp_path / "ckpt" / RNG_FILE).is_file()
    second = host.create(config, total_steps=10)
    second.load_checkpoint(tmp_path / "ckpt").result()
    for backend in (first, second):  # the same next step: AdamW's moments came back too
        backend.forward_backward(batch, nll_loss)
        backend.optim_step().result()
    assert _same_weights(first.get_weights(), second.get_weights())


def test_errors_come_back_with_the_childs_traceback(
    tiny_model_dir: Path, host: TrainerProcess, tmp_path: Path
) -> None:
    remote = host.create(tiny_config(tiny_model_dir), total_steps=10)
    with pytest.raises(FileNotFoundError) as info:
        remote.load_checkpoint(tmp_path / "nowhere").result()
    assert any(f"trainer process (pid {host.pid})" in n for n in info.value.__notes__)
    with pytest.raises(TypeError, match="training.trainer_process"):
        remote.forward_backward(make_batch(LENGTHS), lambda outputs, batch: None)
    metrics = remote.forward_backward(make_batch(LENGTHS), nll_loss).result()  # still serving
    assert metrics["loss"] > 0


def test_a_killed_trainer_fails_every_call_with_its_pid_and_exit_code(
    tiny_model_dir: Path, host: TrainerProcess
) -> None:
    remote = host.create(tiny_config(tiny_model_dir), total_steps=10)
    pending = remote.forward_backward(make_batch([200] * 64), nll_loss)
    os.kill(host.pid, signal.SIGKILL)
    with pytest.raises(TrainerProcessError, match=rf"pid {host.pid}.*exit code -9"):
        pending.result(timeout_s=60)
    with pytest.raises(TrainerProcessError, match="exit code -9"):
        remote.optim_step().result(timeout_s=60)
    remote.close()  # nothing left to stop: no error, no hang
    host.close()


def test_a_backend_that_cannot_be_built_fails_its_next_calls_with_the_reason(
    tiny_model_dir: Path, host: TrainerProcess, tmp_path: Path
) -> None:
    missing = tmp_path / "no-model"
    broken = host.create(tiny_config(missing), total_steps=10)  # returns before it is built
    for _ in range(2):  # the creation's own error, every time (not a lookup failure)
        with pytest.raises(Exception, match="no-model") as info:
            broken.forward_backward(make_batch(LENGTHS), nll_loss).result(timeout_s=120)
        assert not isinstance(info.value, (KeyError, TrainerProcessError)), info.value
    works = host.create(tiny_config(tiny_model_dir), total_steps=10)  # the process still serves
    assert works.forward_backward(make_batch(LENGTHS), nll_loss).result()["loss"] > 0
    broken.close()  # never built: closes without an error


def test_the_trainer_process_ends_when_its_driver_is_killed(tiny_model_dir: Path) -> None:
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from rollouts.trainer.process import TrainerProcess\n"
            "host = TrainerProcess(threads=1)\n"
            "print(host.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    child = int(driver.stdout.readline())
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"the trainer process {child} outlived its driver"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
