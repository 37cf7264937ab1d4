"""Docstrings that state what the code does (issue 27 item 13): a newcomer reads them first."""

from __future__ import annotations

import numpy as np

import rollouts.algorithms.schedule as schedule
import rollouts.data.buffer as buffer


def test_the_buffer_docstring_names_the_seeding_the_code_uses() -> None:
    doc = buffer.__doc__ or ""
    assert "default_rng([seed, epoch])" in doc and "seed + epoch" not in doc, doc
    for seed, epoch in ((0, 1), (1, 0), (3, 2)):
        expected = np.random.default_rng([seed, epoch]).permutation(7).tolist()
        assert buffer.epoch_order(7, epoch, seed, shuffle=True) == expected
    # "seed + epoch" would make these two the same order; they are not
    assert buffer.epoch_order(50, 1, 0, True) != buffer.epoch_order(50, 0, 1, True)


def test_the_schedule_docstrings_say_it_gets_the_rl_step() -> None:
    for doc in (schedule.ScheduleFn.__doc__ or "", schedule.__doc__ or ""):
        assert "RL step" in doc, doc
    assert "at optimizer step" not in (schedule.ScheduleFn.__doc__ or "")
