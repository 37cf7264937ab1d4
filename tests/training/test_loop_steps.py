"""A step is an update (issue 27, item 1): a batch that trains nothing (here: async mode with
`max_staleness = 0`, where every other batch is too stale) is not logged as a step, is counted
apart, and leaves the policy version and the step count equal; the checkpoint keeps the batch
count, so a resumed run numbers its batches (and seeds) on. Item 2: groups the trainer drops as
stale count as thrown-away generation."""

from __future__ import annotations

import json
from pathlib import Path

from rollouts.driver.quick_start import quick_start_training
from rollouts.loop.batch import prepare_groups
from rollouts.types import Sample, Status
from tests.training.test_async_weight_sync import (
    PROMPTS,
    _overrides,
    _rows,
    reward_last_token_parity,
)


def test_batches_that_train_nothing_are_not_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    overrides = _overrides()
    overrides["rollout"]["max_staleness"] = 0
    result = quick_start_training(
        tiny_model_dir,
        PROMPTS,
        reward_last_token_parity,
        num_iterations=3,
        output_dir=tmp_path / "run",
        overrides=overrides,
    )
    rows = _rows(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["policy/version"] == r["step"] for r in rows), rows  # one update per step
    assert all(r["rollout/groups_kept"] == 2.0 for r in rows), rows
    assert all(r["rollout/stale_groups_dropped"] == 0.0 for r in rows), rows
    empty = sum(r["rollout/empty_batches"] for r in rows)
    assert empty >= 1, rows  # the stale batches, counted apart
    assert result.checkpoint is not None
    saved = json.loads((result.checkpoint / "extra_state.json").read_text())["rl_loop"]
    assert saved["empty_batches"] == empty
    assert saved["batch"] == 3 + empty  # the batch the last step trained


def test_groups_dropped_as_stale_at_training_count_their_tokens() -> None:
    """Issue 27, item 2: the trainer's stale drops are thrown-away generation too."""

    def sample(version: str, n: int) -> Sample:
        return Sample(
            index=0,
            group_index=int(version),
            prompt="p",
            tokens=(1,) + (2,) * n,
            loss_mask=(0,) + (1,) * n,
            response_length=n,
            status=Status.COMPLETED,
            weight_versions=(version,),
        )

    prep = prepare_groups([[sample("1", 3), sample("1", 4)], [sample("3", 5)]], "3", 1)
    assert (prep.stale_groups, prep.stale_tokens, len(prep.groups)) == (1, 7, 1)
