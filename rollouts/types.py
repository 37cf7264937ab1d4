"""Frozen data records that flow between the stages of the loop.

One record per stage: a `Sample` is derived from the previous one with `dataclasses.replace`,
never mutated. `TrainFuture` is the handle a training backend returns for work it runs off the
trio thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import trio

T = TypeVar("T")

Message = Mapping[str, Any]
Prompt = str | tuple[Message, ...]
Reward = float | tuple[float, ...]


class Status(enum.Enum):
    """Where a sample stands: PENDING before generation, then one of the finished states."""

    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped (EOS or a stop string / token)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # generation was cut short (surplus over-sampling, weight sync)
    FAILED = "failed"  # generate_fn or reward_fn raised; never trained on


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PromptItem:
    """One row of a prompt dataset: the prompt (text or chat messages) and its label."""

    index: int
    prompt: Prompt
    label: Any = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.index >= 0, f"{self.index=} must be >= 0"
        assert isinstance(self.prompt, (str, tuple)), f"{type(self.prompt)=} must be str or tuple"


def only_0_and_1(values: Sequence[Any]) -> bool:
    """Every value is 0 or 1 (True, 1.0 count too): as bytes, in 4 us for 1k tokens (a set
    takes 12-16, and every stage of a sample checks its mask again); else by a set."""
    try:
        return not bytearray(values).translate(None, b"\x00\x01")
    except (TypeError, ValueError):  # a float, or an int that is no byte
        return set(values) <= {0, 1}


MASKS_KEPT = 1024  # checked loss masks remembered (`_checked_mask`)
MASK_TOKENS_KEPT = 2_000_000  # ... and their tokens at most (8 bytes each: 16 MB)
_CHECKED_MASKS: dict[int, tuple[int, ...]] = {}
_checked_tokens = [0]


def _checked_mask(mask: Sequence[Any]) -> bool:
    """`only_0_and_1(mask)`, told once per tuple: each stage derives a sample from the last one
    (`dataclasses.replace`) with the same mask, and a tuple cannot change (the one kept here
    keeps its id from being reused). 50 ns against 3 us for 1k tokens; the last MASKS_KEPT
    (a sample's stages in its group's task: generated, scored, timed, follow each other)."""
    key = id(mask)
    if _CHECKED_MASKS.get(key) is mask:
        return True
    if not only_0_and_1(mask):
        return False
    if isinstance(mask, tuple):
        full = len(_CHECKED_MASKS) >= MASKS_KEPT or _checked_tokens[0] >= MASK_TOKENS_KEPT
        if full:  # one call each: safe beside samples made in worker threads
            _CHECKED_MASKS.clear()
            _checked_tokens[0] = 0
        _CHECKED_MASKS[key] = mask
        _checked_tokens[0] += len(mask)
    return True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One trajectory: prompt tokens followed by response tokens, with a per-token loss mask.

    `loss_mask` covers every token (prompt tokens are 0). `rollout_logprobs` holds the engine's
    logprob of each response token (len == response_length). `weight_versions` lists every policy
    version that produced part of the response (several when a partial rollout was resumed).
    `teacher_logprobs` (on-policy distillation): the teacher's logprob of each response token
    given everything before it (len == response_length), once scored; `teacher_top` (top-k
    distillation, `algorithm.distill.top_k`): at each response token's position, the teacher's
    k likeliest (token id, logprob), in rank order.
    """

    index: int  # dataset index of the prompt
    group_index: int  # which group (prompt instance) of the batch this sample belongs to
    prompt: Prompt
    label: Any = None
    tokens: tuple[int, ...] = ()
    loss_mask: tuple[int, ...] = ()
    response_length: int = 0
    rollout_logprobs: tuple[float, ...] = ()
    reward: Reward | None = None
    status: Status = Status.PENDING
    weight_versions: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    teacher_logprobs: tuple[float, ...] = ()
    teacher_top: tuple[tuple[tuple[int, float], ...], ...] = ()

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.loss_mask), (
            f"{len(self.tokens)=} != {len(self.loss_mask)=}"
        )
        assert 0 <= self.response_length <= len(self.tokens), (
            f"{self.response_length=} out of [0, {len(self.tokens)=}]"
        )
        assert not self.rollout_logprobs or len(self.rollout_logprobs) == self.response_length, (
            f"{len(self.rollout_logprobs)=} != {self.response_length=}"
        )
        assert _checked_mask(self.loss_mask), "loss_mask values must be 0 or 1"
        assert not self.teacher_logprobs or len(self.teacher_logprobs) == self.response_length, (
            f"{len(self.teacher_logprobs)=} != {self.response_length=}"
        )
        assert not self.teacher_top or len(self.teacher_top) == self.response_length, (
            f"{len(self.teacher_top)=} != {self.response_length=}"
        )

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens (everything before the response)."""
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> tuple[int, ...]:
        return self.tokens[self.prompt_length :]

    @property
    def weight_version(self) -> str | None:
        """The newest policy version that generated part of this sample."""
        return self.weight_versions[-1] if self.weight_versions else None


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A JSON-safe dict of a sample (for checkpoints of the partial pool and rollout logs)."""
    out = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    out["status"] = sample.status.value
    out["prompt"] = sample.prompt if isinstance(sample.prompt, str) else list(sample.prompt)
    for key in ("tokens", "loss_mask", "rollout_logprobs", "weight_versions", "teacher_logprobs"):
        out[key] = list(out[key])
    out["teacher_top"] = [[list(pair) for pair in step] for step in sample.teacher_top]
    out["reward"] = list(sample.reward) if isinstance(sample.reward, tuple) else sample.reward
    out["metadata"] = dict(sample.metadata)
    return out


def sample_from_dict(data: Mapping[str, Any]) -> Sample:
    """Inverse of `sample_to_dict`."""
    prompt = data["prompt"]
    reward = data.get("reward")
    return Sample(
        index=data["index"],
        group_index=data["group_index"],
        prompt=prompt if isinstance(prompt, str) else tuple(dict(m) for m in prompt),
        label=data.get("label"),
        tokens=tuple(data.get("tokens", ())),
        loss_mask=tuple(data.get("loss_mask", ())),
        response_length=data.get("response_length", 0),
        rollout_logprobs=tuple(data.get("rollout_logprobs", ())),
        reward=tuple(reward) if isinstance(reward, list) else reward,
        status=Status(data.get("status", "pending")),
        weight_versions=tuple(data.get("weight_versions", ())),
        metadata=dict(data.get("metadata", {})),
        teacher_logprobs=tuple(data.get("teacher_logprobs", ())),
        teacher_top=tuple(
            tuple((int(t), float(lp)) for t, lp in step) for step in data.get("teacher_top", ())
        ),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutBatch:
    """A batch of groups of samples produced by one rollout round, plus its statistics.

    `failed` holds FAILED samples of the groups the batch dropped (the first few, for the
    console and rollouts.jsonl; `metadata["failures"]` counts them all by reason)."""

    groups: tuple[tuple[Sample, ...], ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    failed: tuple[Sample, ...] = ()

    def __post_init__(self) -> None:
        for s in self.failed:
            assert s.status is Status.FAILED, f"sample {s.index} in `failed` is {s.status}"
        for group in self.groups:
            assert group, "a group must hold at least one sample"
            assert len({s.group_index for s in group}) == 1, "a group mixes group_index values"

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(s for group in self.groups for s in group)


FULL_PRECISION = "full_precision"  # TrainBatch.metadata key: logprobs without autocast
# TrainBatch.metadata key: `compute_logprobs` gives, at each trained token, 1.0 where the model's
# argmax is that token and 0.0 where it is not, instead of its logprob (SFT's held-out accuracy)
ARGMAX_MATCH = "argmax_match"


# TrainBatch's per-sequence fields that may be empty (only training reads them: a batch to
# score is sent without them, `trainer.remote.to_score`)
OPTIONAL_SEQUENCE_FIELDS = (
    "advantages",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "returns",
    "old_values",
    "teacher_top_ids",
    "teacher_top_logprobs",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainBatch:
    """Ragged sequences ready for a training backend.

    Each per-token field is a tuple of 1-D tensors aligned with `input_ids` (one per sequence).
    Logprob fields hold at position t the logprob of token t given tokens < t (position 0 is 0).
    `num_global_tokens` / `num_global_seqs` / `max_response_length` are the normalisers of the
    WHOLE batch (across micro-batches and data-parallel ranks), so that gradient accumulation gives
    the gradient of one big batch.
    """

    input_ids: tuple[Any, ...]  # [T_i] long
    loss_mask: tuple[Any, ...]  # [T_i] float (1 = trained token)
    advantages: tuple[Any, ...] = ()  # [T_i] float
    rollout_logprobs: tuple[Any, ...] = ()  # [T_i] float, engine's
    old_logprobs: tuple[Any, ...] = ()  # [T_i] float, trainer's before the update
    ref_logprobs: tuple[Any, ...] = ()  # [T_i] float, reference model's
    returns: tuple[Any, ...] = ()  # [T_i] float (PPO with a critic)
    old_values: tuple[Any, ...] = ()  # [T_i] float (PPO with a critic)
    # top-k distillation: [T_i, K] the teacher's K likeliest tokens predicting token t, and
    # their logprobs (prompt positions: id 0, logprob 0; their loss mask is 0)
    teacher_top_ids: tuple[Any, ...] = ()
    teacher_top_logprobs: tuple[Any, ...] = ()
    num_global_tokens: float = 0.0
    num_global_seqs: float = 0.0
    max_response_length: int = 0
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        assert len(self.loss_mask) == n, f"{len(self.loss_mask)=} != {n=}"
        for name in OPTIONAL_SEQUENCE_FIELDS:
            field = getattr(self, name)
            assert not field or len(field) == n, f"{name}: {len(field)=} != {n=}"
        for ids, mask in zip(self.input_ids, self.loss_mask, strict=True):
            assert ids.shape == mask.shape, f"{ids.shape=} != {mask.shape=}"

    def __len__(self) -> int:
        return len(self.input_ids)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with each per-sequence field as one buffer (`ragged.Ragged`): the fields are
        views of one storage (`make_train_batch`), which torch would pickle whole for each."""
        from rollouts.ragged import packed

        fields = {f.name: packed(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return (_train_batch, (fields,))

    def to(self, device: Any) -> TrainBatch:
        """The same batch with every per-token tensor on `device` (no copy where it is)."""
        updates: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value:
                updates[f.name] = tuple(t.to(device) for t in value)
        return dataclasses.replace(self, **updates)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A sub-batch (micro-batch) that keeps the global normalisers of the whole batch."""
        updates: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value:
                updates[f.name] = tuple(value[i] for i in indices)
        return dataclasses.replace(self, **updates)


def _train_batch(fields: dict[str, Any]) -> TrainBatch:
    """A pickled TrainBatch again (`TrainBatch.__reduce__`)."""
    from rollouts.ragged import unpacked

    return TrainBatch(**{name: unpacked(value) for name, value in fields.items()})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelOutputs:
    """What a backend's forward pass gives a loss function, per sequence, aligned with input_ids.

    `logprobs[i][t]` = log p(token t | tokens < t) (position 0 is 0); `entropy[i][t]` is the
    entropy of the distribution that predicted token t; `values[i][t]` the critic's value there.
    Logprobs and entropies of tokens whose loss_mask is 0 are not computed and hold 0 (the LM head
    runs on trained tokens only), unless `training.logprob_positions = "all"`.
    """

    logprobs: tuple[Any, ...]
    entropy: tuple[Any, ...] = ()
    values: tuple[Any, ...] = ()
    # [T_i, K]: log p(the teacher's top-K tokens | tokens < t), when the batch carries them
    top_logprobs: tuple[Any, ...] = ()


class LossFn(Protocol):
    """The seam between algorithms and backends.

    Returns the loss of a micro-batch ALREADY normalised by the batch's global counts
    (`TrainBatch.num_global_tokens` etc.), so a backend just sums gradients over micro-batches;
    and metrics that are additive over micro-batches (each also normalised globally), so the
    backend sums them to get the batch's value. `needs_values`: the backend computes the critic's
    values (`ModelOutputs.values`); `needs_entropy`: the loss trains on the entropy, so a backend
    asked for it keeps its graph (else the entropy is a detached metric).
    """

    @property
    def needs_values(self) -> bool: ...

    @property
    def needs_entropy(self) -> bool: ...

    def __call__(
        self, outputs: ModelOutputs, batch: TrainBatch
    ) -> tuple[Any, dict[str, float]]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlainLoss:
    """A `LossFn` from a plain function (SFT, tests): no values; an entropy asked for keeps its
    graph unless `needs_entropy` is False."""

    fn: Callable[[ModelOutputs, TrainBatch], tuple[Any, dict[str, float]]]
    needs_values: bool = False
    needs_entropy: bool = True

    def __call__(self, outputs: ModelOutputs, batch: TrainBatch) -> tuple[Any, dict[str, float]]:
        return self.fn(outputs, batch)


class TrainFuture(Generic[T]):
    """The result of work submitted to a training backend; `await` it under trio.

    Wraps a `concurrent.futures.Future` run by the backend's worker thread, so the trio loop keeps
    serving rollouts while the step runs. `result()` blocks, for code outside trio (torchrun ranks).
    """

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout_s: float | None = None) -> T:
        return self._future.result(timeout=timeout_s)

    async def wait(self) -> T:
        if not self._future.done():
            await trio.to_thread.run_sync(self._future.exception, abandon_on_cancel=True)
        return self._future.result()

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()


class ImmediateTrainFuture(TrainFuture[T]):
    """A future whose value is already known (work that ran synchronously)."""

    __slots__ = ()

    def __init__(self, value: T) -> None:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_result(value)
        super().__init__(future)
