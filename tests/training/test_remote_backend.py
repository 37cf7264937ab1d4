"""The one proxy for a backend elsewhere (`trainer/remote.py`), used by the trainer process and
the torchrun mirror: every method of the Protocols it stands for, with their parameters; each
call sent by name with absolute paths; the far side's error back with its words; the blocking
calls blocking; the capabilities only where the far backend has them. The transports themselves:
test_trainer_process.py (a real child) and test_train_e2e.py (torchrun, two ranks)."""

from __future__ import annotations

import concurrent.futures
import gc
import inspect
from pathlib import Path
from typing import Any

import pytest

from rollouts.trainer.protocol import LoraAdapters, TrainingBackend, WeightSnapshots
from rollouts.trainer.remote import RemoteBackend, WeightSnapshot


class _Link:
    """A link that answers every call at once with what it was sent (or a far-side error)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.sent: list[tuple[str, tuple, dict]] = []
        self.pinned: list[tuple[int, ...]] = []
        self.barriers = 0
        self.closed = False
        self.error = error

    def call(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.sent.append((name, args, kwargs))
        self.collector_on = gc.isenabled()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(7 if name == "snapshot_weights" else {"name": name})
        return future

    def pin_thread(self, cores: tuple[int, ...]) -> None:
        self.pinned.append(cores)

    def barrier(self) -> None:
        self.barriers += 1

    def close(self) -> None:
        self.closed = True


def _methods(protocol: type) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("protocol", [TrainingBackend, LoraAdapters, WeightSnapshots])
def test_the_proxy_has_every_method_of_the_protocol_with_its_parameters(protocol: type) -> None:
    names = _methods(protocol)
    assert names, f"{protocol.__name__} declares no methods"
    for name in names:
        ours = list(inspect.signature(getattr(RemoteBackend, name)).parameters)
        theirs = list(inspect.signature(getattr(protocol, name)).parameters)
        assert ours == theirs, f"{protocol.__name__}.{name}: {ours=} != {theirs=}"
    proxy = RemoteBackend(_Link(), adapters=True, snapshots=True)
    assert isinstance(proxy, protocol)


def test_each_call_goes_by_name_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    link = _Link()
    proxy = RemoteBackend(link, world_size=4, adapters=True, snapshots=False)
    assert (proxy.rank, proxy.world_size) == (0, 4)
    assert proxy.save_checkpoint(Path("ckpt")).result() == {"name": "save_checkpoint"}
    proxy.save_adapter(Path("adapter"))
    proxy.forward_backward("batch", "loss", entropy=True)  # type: ignore[arg-type]
    assert link.sent[0] == ("save_checkpoint", (tmp_path / "ckpt",), {})
    assert link.sent[1] == ("save_adapter", (tmp_path / "adapter",), {})
    assert link.sent[2] == ("forward_backward", ("batch", "loss"), {"entropy": True})
    assert proxy.get_weights() == {"name": "get_weights"}  # blocks: the value, not a future
    proxy.pin_thread({3, 1})
    proxy.barrier()
    proxy.close()
    assert link.pinned == [(1, 3)] and link.barriers == 1 and link.closed


def test_the_capabilities_are_there_only_when_the_far_backend_has_them() -> None:
    plain = RemoteBackend(_Link(), adapters=False, snapshots=False)
    assert plain.lora_adapters() is None and plain.weight_snapshots() is None
    link = _Link()
    full = RemoteBackend(link, adapters=True, snapshots=True)
    assert full.lora_adapters() is full and full.weight_snapshots() is full
    snapshot = full.snapshot_weights()
    assert snapshot == WeightSnapshot(7)
    full.write_weights(snapshot, Path("/w/v_1"))
    assert link.sent[-1] == ("write_weights", (7, Path("/w/v_1")), {})
    with pytest.raises(AssertionError, match="type"):
        full.write_weights({"weights": 1}, Path("/w/v_2"))


def test_an_error_of_the_far_side_comes_back_with_its_words() -> None:
    proxy = RemoteBackend(
        _Link(FileNotFoundError("/nowhere: no checkpoint")), adapters=False, snapshots=False
    )
    future = proxy.load_checkpoint(Path("/nowhere"))
    with pytest.raises(FileNotFoundError, match="/nowhere: no checkpoint"):
        future.result()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        proxy.get_weights()


def test_a_call_is_packed_and_sent_with_the_cyclic_collector_paused() -> None:
    """A step's batch is packed and pickled for the link in one go: hundreds of MB and a view
    per sample and field, none of them cyclic garbage; with the collector on, each call set off
    full collections over the whole heap (32k samples of `scripts/bench_driver.py`: the tail
    7.2-7.7 s, against 6.5-6.9 s paused)."""
    link = _Link()
    proxy = RemoteBackend(link, adapters=False, snapshots=False)
    assert gc.isenabled()
    proxy.forward_backward("batch", "loss")  # type: ignore[arg-type]
    assert link.collector_on is False and gc.isenabled()
