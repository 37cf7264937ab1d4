"""Checkpoints of the RL loop: what one holds, and the rescue before an error stops the run.

A checkpoint of step k holds the model and optimizer (the driver's hook), the loop's state
(`LoopState.to_checkpoint`), the DataBuffer state from which the run goes on and, in async
mode, the batch already made ahead for step k+1 (`BatchSource.held_state`), which a resumed run
trains first.
"""

from __future__ import annotations

import trio

from rollouts.loop.sources import Batches
from rollouts.loop.state import LoopState, RLHooks


async def checkpoint(
    hooks: RLHooks, batches: Batches, st: LoopState, metrics: dict[str, float]
) -> None:
    """Checkpoint step `st.step`: with the buffer state (and the batch made ahead, if one is
    held) from which the run goes on."""
    next_number = st.step_batch + 1
    loop_state = st.to_checkpoint()
    held = batches.held_state()
    if held is not None:
        assert held["number"] == next_number, f"{held['number']=} != {next_number=}"
        loop_state["next_batch"] = held
        next_number += 1
    st.in_backend = True
    await hooks.checkpoint(
        st.step,
        str(st.version),
        batches.state_for_resume(next_number),
        metrics=metrics,
        loop_state=loop_state,
    )
    st.in_backend = False
    st.checkpointed = st.step


async def checkpoint_unsaved(hooks: RLHooks, batches: Batches, st: LoopState) -> bool:
    """Checkpoint the last step when it has none yet (and some step was trained)."""
    if st.in_backend or st.step <= st.checkpointed:
        return False
    with trio.CancelScope(shield=True):
        await checkpoint(hooks, batches, st, st.step_metrics)
    return True


async def rescue_checkpoint(
    error: Exception, hooks: RLHooks, batches: Batches, st: LoopState
) -> None:
    """Checkpoint the last trained step before `error` stops the run, when it came from outside
    the backend (the engines died, a weight sync or evaluation failed, a reward function raised)
    and that step has no checkpoint yet: the steps since the last periodic checkpoint are kept
    and `--resume` continues after them. The error gets a note saying which step was saved."""
    try:
        saved = await checkpoint_unsaved(hooks, batches, st)
    except Exception as failed:
        error.add_note(f"[train] the rescue checkpoint of step {st.step} failed too: {failed!r}")
        return
    if not saved:
        return
    note = f"[train] step {st.step} (the last trained one) was checkpointed before the run stopped"
    print(f"{note}; fix the cause below and continue it with --resume", flush=True)
    error.add_note(f"{note}: continue it with --resume")
