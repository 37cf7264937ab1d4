"""Pure decisions of the batching scheduler: admission, stopping, text trimming.

The worker loop (`core.py`) owns the tensors and the threads; everything it decides goes through
these functions, which take plain values and return plain values, so they are tested without a
model or a server.
"""

from __future__ import annotations

import dataclasses
import time

from rollouts.wire.generation import FinishReason

GATHER_GAP_S = 0.02  # a burst of requests has ended after this long without a new one
GATHER_MAX_S = 0.5  # a fresh batch waits at most this long for the rest of a burst


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Stop:
    """Why a sequence stops after its latest token; `matched` is the token id or stop string."""

    reason: FinishReason
    matched: int | str | None = None


def admit_count(*, active: int, waiting: int, max_batch: int, max_prefill: int) -> int:
    """How many waiting sequences join the running batch now (continuous batching).

    Every free slot is filled at once, but at most `max_prefill` per step so that one burst of
    long prompts cannot stall the decode of the sequences already running for long.
    """
    assert active <= max_batch, f"{active=} > {max_batch=}"
    assert max_prefill >= 1, f"{max_prefill=}"
    return max(0, min(waiting, max_batch - active, max_prefill))


def keep_gathering(*, waiting: int, max_batch: int, since_last_s: float, gathered_s: float) -> bool:
    """Whether a fresh batch (nothing running) waits a moment longer before its prefill.

    Requests of one rollout batch arrive as a burst over HTTP; starting on the first few would
    decode small batches while the rest trickle in one prefill at a time. So the worker waits
    while the burst lasts: until a full batch waits, no request came for `GATHER_GAP_S`, or
    `GATHER_MAX_S` passed (a lone request pays at most the gap).
    """
    assert max_batch >= 1, f"{max_batch=}"
    assert since_last_s >= 0 and gathered_s >= 0, f"{since_last_s=} {gathered_s=}"
    return waiting < max_batch and since_last_s < GATHER_GAP_S and gathered_s < GATHER_MAX_S


def can_enqueue(*, queued: int, max_queue: int) -> bool:
    """A bounded waiting queue: a full queue refuses (503) rather than growing."""
    return queued < max_queue


def stop_after_token(
    *,
    token: int,
    num_output: int,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    eos_token_ids: tuple[int, ...],
    ignore_eos: bool,
    text: str | None,
    stop: tuple[str, ...],
    text_before_len: int,
) -> Stop | None:
    """Whether a sequence ends with the token it just produced (`num_output` includes it).

    Order: a stop token id, EOS (unless ignored), a stop string that ends in the new text
    (`text[text_before_len - longest stop:]` is searched so each match is found once), length.
    """
    assert num_output >= 1, f"{num_output=}"
    if token in stop_token_ids:
        return Stop(reason=FinishReason.STOP, matched=token)
    if not ignore_eos and token in eos_token_ids:
        return Stop(reason=FinishReason.STOP, matched=token)
    if stop and text is not None:
        matched = find_stop(text, stop, text_before_len)
        if matched is not None:
            return Stop(reason=FinishReason.STOP, matched=matched[1])
    if num_output >= max_new_tokens:
        return Stop(reason=FinishReason.LENGTH, matched=None)
    return None


def find_stop(text: str, stop: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that overlaps `text[new_from:]`: (start index, string)."""
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, new_from - len(s) + 1)
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best


def trim_text(text: str, stop: tuple[str, ...], matched: int | str | None, keep: bool) -> str:
    """The visible text: cut at the matched stop string, keeping the string itself if `keep`."""
    if not isinstance(matched, str) or matched not in stop:
        return text
    at = text.find(matched)
    if at < 0:  # e.g. the stop string was a special token and was skipped in the text
        return text
    return text[: at + len(matched)] if keep else text[:at]


def allowed_new_tokens(*, prompt_len: int, max_new_tokens: int, context_len: int) -> int:
    """max_new_tokens capped so prompt + output fits the context (then the finish is LENGTH)."""
    assert prompt_len < context_len, f"{prompt_len=} >= {context_len=}"
    return min(max_new_tokens, context_len - prompt_len)


@dataclasses.dataclass(slots=True)
class BusyStats:
    """What the worker did since its batch was last empty (logged when it drains again)."""

    started_s: float = dataclasses.field(default_factory=time.monotonic)
    steps: int = 0  # decode steps
    rows: int = 0  # rows decoded, summed over steps
    decode_s: float = 0.0  # forward + sampling + bookkeeping of the decode steps
    prefills: int = 0
    prompts: int = 0  # sequences admitted
    distinct: int = 0  # distinct prompts prefilled for them
    shared: int = 0  # their tokens taken from a shared prefix instead of prefilled
    prefill_s: float = 0.0

    def summary(self) -> str:
        """One log line: ms per decode step and mean batch, prefills and their sharing."""
        per_step = 1000 * self.decode_s / max(self.steps, 1)
        per_prefill = 1000 * self.prefill_s / max(self.prefills, 1)
        return (
            f"batch drained after {time.monotonic() - self.started_s:.3f} s "
            f"(monotonic {self.started_s:.3f}-{time.monotonic():.3f}): "
            f"{self.steps} decode steps, {per_step:.2f} ms/step, mean batch "
            f"{self.rows / max(self.steps, 1):.1f}; {self.prefills} prefills "
            f"({per_prefill:.2f} ms each) of {self.distinct} distinct prompts for "
            f"{self.prompts} sequences ({self.shared} prompt tokens from a shared prefix)"
        )
