"""Checkpoints you can trust (issue 45): checksums in the manifest, verified before a resume and
before RL starts from an SFT checkpoint, and the resume contract (`rollouts/driver/resume.py`).

The train.py tests damage a copy of one finished tiny run (`finished_run`, built once per
session). The ones that stop before training run train.py's `main` in this process (about a
second each); the two that train on run it as a process.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from rollouts.driver.cli import main
from rollouts.driver.resume import choose_checkpoint, plan_resume
from rollouts.driver.sft_phase import _write_merged
from rollouts.trainer.checkpoint import save_checkpoint
from rollouts.trainer.checkpoint_verify import (
    Problem,
    Verdict,
    add_to_manifest,
    verify_checkpoint,
)
from rollouts.trainer.factories import create_pytorch_backend
from tests.training.backend_helpers import lora_config, tiny_config
from tests.training.conftest import FinishedRun
from tests.training.test_train_e2e import _steps, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

MODEL = "model/model.safetensors"


def _copy(finished: FinishedRun, tmp: Path) -> Path:
    """A copy of the finished run's directory (the config, model and data stay shared)."""
    run = tmp / "run"
    shutil.copytree(finished.run, run)
    return run


def _overwrite_middle(file: Path, n: int = 64) -> None:
    """`n` bytes in the middle of `file` replaced by other bytes: the same size."""
    with open(file, "r+b") as fh:
        fh.seek(file.stat().st_size // 2)
        old = fh.read(n)
        fh.seek(-len(old), 1)
        fh.write(bytes(b ^ 0x5A for b in old))


def _truncate(file: Path) -> None:
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size // 2)


def _main(
    finished: FinishedRun, run: Path, capsys: pytest.CaptureFixture, *args: str
) -> tuple[int, str, str]:
    """train.py in this process on `run`: its exit code, stdout and stderr (torch's thread
    count, which train.py sets, put back)."""
    threads = torch.get_num_threads()
    try:
        code = main([*args, "--config", str(finished.config), "--set", f"run.output_dir={run}"])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return code, out, err


def _files(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in ("metrics.jsonl", "rollouts.jsonl")}


def test_the_manifest_records_every_file_with_its_size_and_crc32(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    reference = {k: v.clone() for k, v in backend.get_weights().items()}
    path = save_checkpoint(backend, tmp_path, step=1, weight_version="1", reference=reference)
    backend.close()
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()}
    assert set(manifest["files"]) == on_disk - {"manifest.json"}
    assert {MODEL, "optimizer.pt", "reference.safetensors"} <= set(manifest["files"])
    for rel, entry in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel
    assert verify_checkpoint(path).ok


def test_a_lora_sft_checkpoint_s_merged_model_joins_its_manifest(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The merged model/ that sft_phase writes into the last LoRA SFT checkpoint after it was
    finished (RL starts from it) is recorded too: every file of the directory is verified."""
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    path = save_checkpoint(backend, tmp_path, step=1, weight_version="1")
    assert not (path / "model").exists()
    _write_merged(backend, path / "model")
    backend.close()
    add_to_manifest(path, "model")
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()}
    assert set(files) == on_disk - {"manifest.json"} and MODEL in files, files
    assert any(rel.startswith("adapter/") for rel in files), files
    assert verify_checkpoint(path).ok
    _overwrite_middle(path / MODEL)
    assert [p.file for p in verify_checkpoint(path).problems] == [MODEL]


def test_verify_names_the_file_and_what_differed(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    path = save_checkpoint(backend, tmp_path, step=1, weight_version="1")
    backend.close()
    size = (path / "extra_state.json").stat().st_size
    _overwrite_middle(path / MODEL)
    _truncate(path / "extra_state.json")
    (path / "optimizer.pt").unlink()
    verdict = verify_checkpoint(path)
    found = {p.file: p.what for p in verdict.problems}
    assert found.keys() == {MODEL, "extra_state.json", "optimizer.pt"}, found
    assert found[MODEL].startswith("checksum mismatch (crc32 "), found
    assert found["extra_state.json"].startswith(f"size {size // 2} != {size} "), found
    assert found["optimizer.pt"] == "missing"


def test_a_checkpoint_without_checksums_is_accepted_with_a_warning(
    finished_run: FinishedRun, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = _copy(finished_run, tmp_path) / "checkpoints" / "rl"
    newest = root / "step_000003"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["format"] = 1  # as written before checksums: sizes only
    manifest["files"] = {rel: e["size"] for rel, e in manifest["files"].items()}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    (root / "step_000004").mkdir()  # a write a kill cut short: no manifest
    assert choose_checkpoint(root, phase="rl", on_corrupt="stop") == newest
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == f"[train] skipped {root / 'step_000004'}: no manifest.json (a write a kill cut short)"
    )
    assert out[1].startswith(f"[train] warning: {newest} carries no checksums"), out
    assert out[2] == f"[train] resuming from {newest} (step 3)"


def test_the_resume_plan_follows_the_contract(tmp_path: Path) -> None:
    bad = (Problem(file=MODEL, what="checksum mismatch"),)
    v = [
        Verdict(path=tmp_path / "step_000005", step=5, problems=bad),
        Verdict(path=tmp_path / "step_000004", step=4),
        Verdict(path=tmp_path / "step_000003", step=3),
    ]
    kw = {"root": tmp_path, "phase": "rl"}
    stop = plan_resume(v, on_corrupt="stop", **kw)
    assert stop.path is None and "step_000005 (step 5) failed verification" in stop.error
    assert "step_000004 (step 4), step_000003 (step 3)" in stop.error
    assert "--resume-step 4" in stop.error and "checkpoint.on_corrupt=fall_back" in stop.error
    fall = plan_resume(v, on_corrupt="fall_back", **kw)
    assert (fall.path, fall.step, fall.error) == (tmp_path / "step_000004", 4, "")
    assert fall.notes[0].startswith(f"skipped {tmp_path / 'step_000005'} (step 5)"), fall.notes
    assert plan_resume(v, on_corrupt="stop", step=3, **kw).path == tmp_path / "step_000003"
    assert "failed verification" in plan_resume(v, on_corrupt="fall_back", step=5, **kw).error
    assert "no rl checkpoint of step 9" in plan_resume(v, on_corrupt="stop", step=9, **kw).error
    none = plan_resume(v[:1], on_corrupt="fall_back", **kw)
    assert none.path is None and "no intact rl checkpoint" in none.error
    assert plan_resume([], on_corrupt="stop", **kw).path is None  # a new run


@pytest.mark.parametrize(
    ("damage", "file", "what"),
    [
        (_overwrite_middle, MODEL, "checksum mismatch"),  # 64 bytes, the same size
        (_truncate, MODEL, "size "),
        (Path.unlink, "optimizer.pt", "missing"),
        (_truncate, "extra_state.json", "size "),
    ],
)
def test_a_damaged_newest_checkpoint_stops_the_resume_naming_the_file(
    finished_run: FinishedRun,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    damage,
    file: str,
    what: str,
) -> None:
    run = _copy(finished_run, tmp_path)
    before = _files(run)
    damage(run / "checkpoints" / "rl" / "step_000003" / file)
    code, _, err = _main(finished_run, run, capsys, "--mode", "rl", "--resume")
    assert code != 0, err
    assert f"error: checkpoint {run}/checkpoints/rl/step_000003 (step 3) failed" in err, err
    assert f"{file}: {what}" in err, err
    assert "intact rl checkpoints: step_000002 (step 2)" in err, err
    assert "--resume-step 2" in err and "--set checkpoint.on_corrupt=fall_back" in err, err
    assert _files(run) == before  # nothing written over


def test_no_intact_checkpoint_stops_and_keeps_the_history(
    finished_run: FinishedRun, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(finished_run, tmp_path)
    before = _files(run)
    for step in ("step_000002", "step_000003"):
        _truncate(run / "checkpoints" / "rl" / step / MODEL)
    code, _, err = _main(finished_run, run, capsys, "--mode", "rl", "--resume")
    assert code != 0, err
    assert "no intact rl checkpoint is left" in err and "rather than start over" in err, err
    assert _files(run) == before  # not started over: the run's history is as it was


def test_a_corrupt_sft_checkpoint_refuses_the_rl_start(
    finished_run: FinishedRun, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(finished_run, tmp_path)
    sft = run / "checkpoints" / "sft" / "step_000006"
    _overwrite_middle(sft / MODEL)
    # RL pointed at the SFT checkpoint's model by the config
    fresh = tmp_path / "rl-from-sft"
    pointed = ("--set", f"model.path={sft / 'model'}")
    code, _, err = _main(finished_run, fresh, capsys, "--mode", "rl", *pointed)
    assert code != 0, err
    assert f"{sft} (step 6) failed verification: {MODEL}: checksum mismatch" in err, err
    assert not (fresh / "metrics.jsonl").exists()
    # sft+rl resumed before RL has a checkpoint: SFT's newest is verified, and refused
    shutil.rmtree(run / "checkpoints" / "rl")
    code, _, err = _main(finished_run, run, capsys, "--mode", "sft+rl", "--resume")
    assert code != 0, err
    assert f"{sft} (step 6) failed verification: {MODEL}: checksum mismatch" in err, err
    assert "intact sft checkpoints: step_000005 (step 5)" in err, err


def test_resume_step_picks_that_step_verified(
    finished_run: FinishedRun, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(finished_run, tmp_path)
    root = run / "checkpoints" / "rl"
    _overwrite_middle(root / "step_000003" / MODEL)
    assert choose_checkpoint(root, phase="rl", on_corrupt="stop", step=2) == root / "step_000002"
    assert capsys.readouterr().out == f"[train] resuming from {root / 'step_000002'} (step 2)\n"
    before = _files(run)
    for step, error in (("3", "(step 3) failed verification"), ("9", "no rl checkpoint of step 9")):
        code, _, err = _main(finished_run, run, capsys, "--mode", "rl", "--resume-step", step)
        assert code != 0, err
        assert error in err and "--resume-step 2" in err, err
    assert _files(run) == before


def test_fall_back_resumes_from_the_newest_intact_checkpoint_and_says_so(
    finished_run: FinishedRun, tmp_path: Path
) -> None:
    """A real run (engines and all, about 15 s): it skips the corrupt step 3, trains step 3
    again from step 2 and checkpoints it anew."""
    run = _copy(finished_run, tmp_path)
    newest = run / "checkpoints" / "rl" / "step_000003"
    _overwrite_middle(newest / MODEL)
    config = ("--config", str(finished_run.config), "--set", f"run.output_dir={run}")
    fall_back = ("--set", "checkpoint.on_corrupt=fall_back")
    done = _train("--mode", "rl", *config, "--resume", *fall_back)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skipped = f"[train] skipped {newest} (step 3) (checkpoint.on_corrupt = 'fall_back'): "
    assert f"{skipped}{MODEL}: checksum mismatch" in done.stdout, done.stdout[-3000:]
    assert f"[train] resuming from {run}/checkpoints/rl/step_000002 (step 2)" in done.stdout
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]  # step 3 trained again, once
    assert verify_checkpoint(newest).ok  # and checkpointed anew
