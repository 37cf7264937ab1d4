"""Pure rollout functions: filters, planning, staleness, batch building, request preparation."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from rollouts.rollout import filters as F
from rollouts.rollout.batch import (
    build_batch_metadata,
    compute_response_lengths,
    convert_to_batch,
    discarded_fraction,
    length_histogram,
)
from rollouts.rollout.generate import apply_completion, prepare_request
from rollouts.rollout.planning import (
    Outcome,
    batch_outcome,
    groups_to_submit,
    in_flight_credit,
    is_stale_partial,
    new_round_state,
    sample_staleness,
    split_stale_groups,
    staleness_bound,
)
from rollouts.types import Sample, Status
from rollouts.wire.generation import Completion, FinishReason, SamplingParams


def done(reward=None, response=(5, 6), status=Status.COMPLETED, versions=("1",), g=0) -> Sample:
    tokens = (1, 2, *response)
    return Sample(
        index=0,
        group_index=g,
        prompt="p",
        tokens=tokens,
        loss_mask=(0, 0) + (1,) * len(response),
        response_length=len(response),
        reward=reward,
        status=status,
        weight_versions=versions,
    )


def test_filters_keep_and_drop_with_reasons() -> None:
    same = [done(1.0), done(1.0)]
    varied = [done(0.0, (5,)), done(1.0, (6,))]
    assert F.check_reward_nonzero_std(same) == F.FilterResult(keep=False, reason="zero_reward_std")
    assert F.check_reward_nonzero_std(varied).keep
    assert F.check_reward_nonzero_std([done((1.0, 0.0)), done((1.0, 2.0))]).keep  # vector
    assert not F.check_min_reward([done(-1.0), done(0.0)]).keep
    assert F.check_min_reward([done(-1.0), done(1.5)], min_reward=0.25).keep
    assert F.check_response_diversity(varied).keep
    assert F.check_response_diversity(same * 2, 0.5).reason == "low_diversity"
    assert F.check_reasonable_length([done(1.0, ())]).reason == "too_short"
    cut = [done(1.0, status=Status.TRUNCATED)] * 2
    assert F.check_reasonable_length(cut).reason == "too_many_truncated"
    assert F.check_quality_and_diversity(same).reason == "zero_reward_std"
    assert F.check_quality_and_diversity(varied).keep


def test_run_filters_order_failed_first_and_bool_filters() -> None:
    failed = [done(1.0), done(status=Status.FAILED)]
    assert F.run_filters(failed, []).reason == "failed"
    assert F.run_filters([done(1.0), done(status=Status.ABORTED)], []).reason == "unfinished"

    def no_ones(group):
        return all(s.reward != 1.0 for s in group)

    assert F.run_filters([done(1.0), done(0.0)], [no_ones]).reason == "no_ones"
    fs = F.resolve_filters(["check_reward_nonzero_std", functools.partial(F.check_min_reward)])
    assert F.run_filters([done(1.0), done(0.0)], fs).keep
    with pytest.raises(Exception, match="nope"):
        F.resolve_filters(["rollouts.rollout.filters.nope"])


def test_planning_waves_and_outcomes() -> None:
    s = new_round_state(4, 1.5)
    assert s.wave == 6
    assert groups_to_submit(s, 1.5, 3) == 6
    s = dataclasses.replace(s, in_flight=6, submitted=6)
    assert s.rounds == 1
    assert groups_to_submit(s, 1.5, 3) == 0  # in flight could still fill the batch
    s = dataclasses.replace(s, in_flight=2, kept=1)  # 3 dropped: 2 in flight cannot fill 3
    assert groups_to_submit(s, 1.5, 3) == 3  # ceil(3 * 1.5) - 2
    assert batch_outcome(s, 3) is Outcome.CONTINUE
    assert batch_outcome(dataclasses.replace(s, kept=4), 3) is Outcome.DONE
    spent = dataclasses.replace(s, in_flight=0, submitted=18)  # 3 waves of 6
    assert spent.rounds == 3
    assert groups_to_submit(spent, 1.5, 3) == 0
    assert batch_outcome(spent, 3) is Outcome.SHORT
    assert batch_outcome(dataclasses.replace(s, in_flight=0, exhausted=True), 9) is Outcome.SHORT


def test_top_ups_share_a_round_and_the_budget_bounds_them() -> None:
    # factor 1.0: a top-up of 1 group after each drop is not a new round
    s = new_round_state(8, 1.0)
    s = dataclasses.replace(s, in_flight=7, submitted=8)  # one group dropped
    assert groups_to_submit(s, 1.0, 4) == 1
    s = dataclasses.replace(s, in_flight=8, submitted=9)
    assert s.rounds == 2  # 9 groups of 8 per wave
    # the budget (4 waves of 8) caps the last top-up
    late = dataclasses.replace(s, kept=0, in_flight=0, submitted=30)
    assert groups_to_submit(late, 1.0, 4) == 2
    assert staleness_bound(-1, "sync", 1) == 0
    assert staleness_bound(-1, "async", 1) == 1
    assert staleness_bound(-1, "sync", 3) == 2
    assert staleness_bound(2, "sync", 1) == 2


def test_top_ups_grow_with_what_the_filters_drop() -> None:
    # no verdicts yet, or a keep rate the factor covers: the fixed factor's rule
    s = new_round_state(4, 2.5, last=(4, 10))
    assert in_flight_credit(s, 2.5) == 1.0
    assert groups_to_submit(s, 2.5, 4) == 10
    s = dataclasses.replace(s, in_flight=4, submitted=10, passed=4, judged=6, kept=2)
    assert groups_to_submit(s, 2.5, 4) == 0  # 4 in flight for 2 missing
    # late in training most groups are all right: 1 of 10 passed, and 3 of 30 the batch before
    late = new_round_state(4, 2.5, last=(3, 30))
    assert in_flight_credit(late, 2.5) == pytest.approx((3 + 4) * 2.5 / (30 + 10))
    assert groups_to_submit(late, 2.5, 4) == math.ceil(4 * 2.5 / ((3 + 4) * 2.5 / 40))
    late = dataclasses.replace(late, in_flight=2, submitted=10, passed=1, judged=8, kept=1)
    credit = (1 + 3 + 4) * 2.5 / (8 + 30 + 10)
    # the fixed rule would submit ceil(3 * 2.5) - 2 = 6
    assert groups_to_submit(late, 2.5, 4) == math.ceil(3 * 2.5 / credit) - 2
    # the budget of max_rounds waves still bounds it
    assert groups_to_submit(dataclasses.replace(late, submitted=35), 2.5, 4) == 5
    # the fixed rule would wait here (3 missing, 4 in flight); at this keep rate it tops up
    waiting = dataclasses.replace(late, in_flight=4)
    assert groups_to_submit(waiting, 2.5, 4) == math.ceil(3 * 2.5 / credit) - 4
    with pytest.raises(AssertionError):
        dataclasses.replace(late, passed=9)  # more passed than judged
    # factor 1: no over-sampling, a drop replaced one for one whatever the keep rate
    one = dataclasses.replace(new_round_state(2, 1.0), in_flight=1, submitted=2, judged=1)
    assert in_flight_credit(one, 1.0) == 1.0
    assert groups_to_submit(one, 1.0, 4) == 1


def test_staleness() -> None:
    assert sample_staleness(("default",), "2") == 2
    assert sample_staleness(("3", "5"), "5") == 2  # the oldest part counts
    fresh, stale = split_stale_groups([[done(versions=("4",))], [done(versions=("1",))]], "5", 1)
    assert len(fresh) == 1
    assert len(stale) == 1
    with pytest.raises(ValueError, match="not an integer"):
        sample_staleness(("v1",), "2")


def test_batch_lengths_metadata_and_histogram() -> None:
    samples = [done(1.0, (5,)), done(0.0, (5, 6, 7))]
    assert compute_response_lengths(samples) == [1, 3]
    assert length_histogram([1, 3, 3], num_bins=3) == {"edges": [1, 2, 3, 4], "counts": [1, 0, 2]}
    meta = build_batch_metadata(
        [tuple(samples)], dropped={"x": 2}, elapsed_s=2.0, generated_tokens=10
    )
    assert meta["dropped_groups"] == 2
    assert meta["tokens_per_s"] == 5.0
    batch = convert_to_batch([samples], meta)
    assert len(batch.samples) == 2
    with pytest.raises(AssertionError, match="status"):
        convert_to_batch([[done(status=Status.ABORTED)]], {})


def completion(ids, reason=FinishReason.ABORT, version="1") -> Completion:
    return Completion(
        output_ids=tuple(ids),
        logprobs=tuple(-1.0 for _ in ids),
        finish_reason=reason,
        weight_version=version,
        prompt_tokens=0,
        completion_tokens=len(ids),
    )


@pytest.mark.parametrize("mask_off_policy", [False, True])
def test_partial_sample_resumes_from_prompt_plus_partial_tokens(tok, mask_off_policy) -> None:
    params = SamplingParams(max_new_tokens=8)
    fresh = Sample(index=0, group_index=0, prompt="ab")
    ids, max_new = prepare_request(fresh, tok, params, 1024)
    assert (ids, max_new) == (tuple(tok("ab")["input_ids"]), 8)
    partial = apply_completion(fresh, ids, completion([7, 8, 9]), mask_off_policy)
    assert partial.status is Status.ABORTED
    assert partial.weight_versions == ("1",)
    ids2, max_new2 = prepare_request(partial, tok, params, 1024)
    assert ids2 == partial.tokens
    assert max_new2 == 5
    final = apply_completion(
        partial, ids2, completion([10, 11], FinishReason.STOP, "2"), mask_off_policy
    )
    assert final.tokens == (*ids, 7, 8, 9, 10, 11)
    assert final.response_length == 5
    assert final.rollout_logprobs == (-1.0,) * 5
    assert final.weight_versions == ("1", "2")
    assert final.status is Status.COMPLETED
    old = (0, 0, 0) if mask_off_policy else (1, 1, 1)
    assert final.loss_mask == (0, 0, *old, 1, 1)
    assert final.metadata["resumed_at"] == [3]
    assert prepare_request(partial, tok, params, len(partial.tokens) + 2)[1] == 2


def test_a_sample_aborted_before_its_first_token_keeps_no_version(tok) -> None:
    """Issue 27, item 3: nothing generated, so no (old) version: its group is not stale."""
    params = SamplingParams(max_new_tokens=8)
    fresh = Sample(index=0, group_index=0, prompt="ab")
    ids, _ = prepare_request(fresh, tok, params, 1024)
    aborted = apply_completion(fresh, ids, completion([], FinishReason.ABORT, "1"), False)
    assert aborted.status is Status.ABORTED
    assert (aborted.tokens, aborted.weight_versions, aborted.response_length) == ((), (), 0)
    started = apply_completion(fresh, ids, completion([7], FinishReason.ABORT, "1"), False)
    assert not is_stale_partial([aborted, aborted], "5", 0)  # nothing in it is old
    assert is_stale_partial([aborted, started], "5", 0)  # its one token is
    assert prepare_request(aborted, tok, params, 1024) == (ids, 8)  # from the prompt
    final = apply_completion(aborted, ids, completion([9], FinishReason.STOP, "5"), False)
    assert final.weight_versions == ("5",) and "resumed_at" not in final.metadata
    # a finished sample with no new token keeps its version (staleness needs one)
    empty_stop = apply_completion(fresh, ids, completion([], FinishReason.STOP, "2"), False)
    assert empty_stop.weight_versions == ("2",)


def test_discarded_fraction_counts_tokens_thrown_away_over_tokens_made() -> None:
    """Issue 27, item 2: work thrown away in a batch (made in it or before) over work made."""
    assert discarded_fraction(0, 0) == 0.0
    assert discarded_fraction(0, 10) == 0.0
    assert discarded_fraction(5, 10) == 0.5
    assert discarded_fraction(30, 10) == 1.0  # a backlog of stale work dropped: at most 1
    assert discarded_fraction(3, 0) == 1.0
