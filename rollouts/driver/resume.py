"""Which checkpoint a resumed phase continues from, verified first (the resume contract).

    --resume            the newest checkpoint of the phase, verified (every file's size and
                        checksum against manifest.json); the console names it and its step
    --resume-step N     exactly step N of the phase being resumed, verified
    checkpoint.on_corrupt = "stop" (default): a checkpoint that fails verification stops the
                        run, naming it, the file and what differed, listing the intact ones and
                        the two ways to fall back; "fall_back": the newest intact one, saying
                        which were skipped and why
A directory `step_*` without a manifest was never complete (a kill mid-write): skipped, and
said. A phase that has checkpoints but none intact stops: it never starts over, so
metrics.jsonl and rollouts.jsonl are left as they are.

`plan_resume` decides from verdicts (pure); `choose_checkpoint` finds and verifies them.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path

import trio

from rollouts.config import Config, RunMode
from rollouts.config.training import OnCorrupt
from rollouts.trainer.checkpoint import STEP_DIR
from rollouts.trainer.checkpoint_verify import MANIFEST, Verdict, verify_checkpoint


class CorruptCheckpoint(RuntimeError):
    """A checkpoint to resume from (or to start RL from) failed verification: an operating
    error, printed as `error: <message>`."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ResumePlan:
    """The checkpoint to load (None: a new run) and what to print first, or the error."""

    path: Path | None = None
    step: int = 0
    notes: tuple[str, ...] = ()  # printed before the run goes on (skipped, legacy warnings)
    error: str = ""  # non-empty: the run stops with it


def _name(v: Verdict) -> str:
    return f"{v.path} (step {v.step})" if v.step >= 0 else str(v.path)


def _failed(v: Verdict) -> str:
    return f"checkpoint {_name(v)} failed verification: {v.describe()}"


def _intact_list(intact: list[Verdict]) -> str:
    return ", ".join(f"{v.path.name} (step {v.step})" for v in intact)


def _fall_back_hint(intact: list[Verdict], root: Path, phase: str) -> str:
    if not intact:
        return (
            f"no intact {phase} checkpoint is left under {root}: the run stops rather than start "
            "over (metrics.jsonl and rollouts.jsonl are kept as they are); restore the files, or "
            "start a new run in another run.output_dir"
        )
    newest = intact[0]
    return (
        f"intact {phase} checkpoints: {_intact_list(intact)}; to resume from one, pass "
        f"--resume-step {newest.step} (or another of those steps), or "
        "--set checkpoint.on_corrupt=fall_back (the newest intact one)"
    )


def _legacy_note(v: Verdict) -> tuple[str, ...]:
    if v.checksummed:
        return ()
    return (
        f"warning: {v.path} carries no checksums (written before manifest format 2): its file "
        "sizes are checked, not its contents",
    )


def plan_resume(
    verdicts: list[Verdict],
    *,
    root: Path,
    phase: str,
    on_corrupt: OnCorrupt,
    step: int | None = None,
) -> ResumePlan:
    """The resume contract, decided. `verdicts`: the phase's checkpoints, newest first (a
    verdict's step is its directory's); `step`: --resume-step N (None: the newest)."""
    assert on_corrupt in ("stop", "fall_back"), f"{on_corrupt=}"
    steps = [v.step for v in verdicts]
    assert steps == sorted(steps, reverse=True), f"verdicts not newest first: {steps}"
    intact = [v for v in verdicts if v.ok]
    if step is not None:
        asked = [v for v in verdicts if v.step == step]
        if not asked:
            known = ", ".join(map(str, steps)) or "none"
            hint = _fall_back_hint(intact, root, phase)
            return ResumePlan(
                error=f"--resume-step {step}: no {phase} checkpoint of step {step} under {root} "
                f"(the steps there: {known}); {hint}"
            )
        if not asked[0].ok:
            return ResumePlan(error=f"{_failed(asked[0])}; {_fall_back_hint(intact, root, phase)}")
        return ResumePlan(path=asked[0].path, step=step, notes=_legacy_note(asked[0]))
    if not verdicts:
        return ResumePlan()
    newest = verdicts[0]
    if newest.ok:
        return ResumePlan(path=newest.path, step=newest.step, notes=_legacy_note(newest))
    if on_corrupt == "stop" or not intact:
        return ResumePlan(error=f"{_failed(newest)}; {_fall_back_hint(intact, root, phase)}")
    chosen = intact[0]
    skipped = tuple(
        f"skipped {_name(v)} (checkpoint.on_corrupt = 'fall_back'): {v.describe()}"
        for v in verdicts
        if v.step > chosen.step
    )
    return ResumePlan(path=chosen.path, step=chosen.step, notes=(*skipped, *_legacy_note(chosen)))


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `step_*` directories under `root`, newest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted((s, p) for s, p in found if p.is_dir())[::-1]


async def checkpoint_to_resume(
    config: Config, root: Path, phase: str, *, resume: bool, step: int | None
) -> Path | None:
    """The verified checkpoint under `root` a phase continues from (None: a new run, or
    `resume` off); `choose_checkpoint` on a worker thread, with checkpoint.on_corrupt."""
    if not resume:
        return None
    on_corrupt = config.checkpoint.on_corrupt
    choose = functools.partial(choose_checkpoint, root, phase=phase, on_corrupt=on_corrupt)
    return await trio.to_thread.run_sync(functools.partial(choose, step=step))


def choose_checkpoint(
    root: Path, *, phase: str, on_corrupt: OnCorrupt, step: int | None = None
) -> Path | None:
    """The verified checkpoint under `root` the phase resumes from (None: none there, a new
    run), printed with its step; raises CorruptCheckpoint when the contract says stop.

    The newest (or asked) one is verified first; the others only when it fails (to list the
    intact ones, or to fall back), so a good resume reads each file of one checkpoint once."""
    found = []
    for number, path in step_dirs(root):
        if not (path / MANIFEST).exists():
            print(f"[train] skipped {path}: no {MANIFEST} (a write a kill cut short)", flush=True)
        else:
            found.append((number, path))
    wanted = found[:1] if step is None else [(n, p) for n, p in found if n == step]
    verdicts = {p: _verify(p, n) for n, p in wanted}
    if any(not v.ok for v in verdicts.values()) or not verdicts:
        verdicts.update({p: _verify(p, n) for n, p in found if p not in verdicts})
    ordered = [verdicts[p] for _, p in found if p in verdicts]
    plan = plan_resume(ordered, root=root, phase=phase, on_corrupt=on_corrupt, step=step)
    for note in plan.notes:
        print(f"[train] {note}", flush=True)
    if plan.error:
        raise CorruptCheckpoint(plan.error)
    if plan.path is not None:
        print(f"[train] resuming from {plan.path} (step {plan.step})", flush=True)
    return plan.path


def _verify(path: Path, number: int) -> Verdict:
    """`verify_checkpoint`, with the step of the directory's name (the manifest's may be
    unreadable)."""
    return dataclasses.replace(verify_checkpoint(path), step=number)


def verify_start_model(model_dir: Path) -> None:
    """When a model directory is a checkpoint's (`checkpoints/sft/step_N/model`: what sft+rl
    hands to RL, or what model.path names), verify that checkpoint before it is used: a
    corrupt one raises CorruptCheckpoint naming the file. Any other directory is left alone."""
    checkpoint = Path(model_dir).parent
    if not STEP_DIR.match(checkpoint.name) or not (checkpoint / MANIFEST).is_file():
        return
    verdict = verify_checkpoint(checkpoint)
    if not verdict.ok:
        raise CorruptCheckpoint(
            f"the model {model_dir} is a checkpoint's, and {_failed(verdict)}; restore it, or "
            "start from an intact checkpoint's model/ (model.path, or sft+rl --resume-step N)"
        )
    for note in _legacy_note(verdict):
        print(f"[train] {note}", flush=True)
    print(f"[train] model {model_dir}: its checkpoint is intact (verified)", flush=True)


def resume_steps(mode: RunMode, rl_root: Path, step: int | None) -> tuple[int | None, int | None]:
    """--resume-step N as (SFT's, RL's): it is for the phase being resumed, RL when the mode
    runs RL and RL has checkpoints (or directories of them), else SFT."""
    assert mode in typing.get_args(RunMode), f"{mode=}"
    if step is None:
        return None, None
    rl_resumed = mode == "rl" or (mode == "sft+rl" and bool(step_dirs(rl_root)))
    return (None, step) if rl_resumed else (step, None)
