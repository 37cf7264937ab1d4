"""The SFT loop: conversations -> loss-masked tokens -> steps on a TrainingBackend.

Conversations are tokenised once with masks from the chat template (assistant turns only,
multi-turn correct: `rollouts.data.sft.tokenize_conversation`), split into train and held-out
eval, and batched in a seeded per-epoch order. The loss is the masked token-mean NLL normalised
by the batch's global token count, so micro-batching inside the backend does not change it.
The held-out set is scored by its loss (`sft/eval_loss`) and its per-token accuracy
(`sft/eval_accuracy`: the share of trained tokens that are the model's argmax), a second pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from rollouts.config import Config
from rollouts.data.limits import TokenLimit
from rollouts.data.sft import tokenize_conversation
from rollouts.loop.state import StepLog
from rollouts.trainer.protocol import TrainingBackend
from rollouts.types import ARGMAX_MATCH, Message, ModelOutputs, PlainLoss, TrainBatch

TokenizedConversation = tuple[list[int], list[int]]
MAX_NAMED = 5  # overlong conversations named in the error; the rest are counted


def sft_loss_fn(outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked NLL summed over the micro-batch, divided by the WHOLE batch's trained tokens."""
    assert batch.num_global_tokens > 0, f"{batch.num_global_tokens=} must be > 0"
    total = sum(
        (lp * mask.to(lp.dtype)).sum()
        for lp, mask in zip(outputs.logprobs, batch.loss_mask, strict=True)
    )
    loss = -total / batch.num_global_tokens
    return loss, {"sft/loss": float(loss.detach())}


def make_sft_batch(examples: Sequence[TokenizedConversation]) -> TrainBatch:
    """A TrainBatch of tokenised conversations with global normalisers set."""
    assert examples, "an SFT batch needs at least one example"
    ids = tuple(torch.tensor(tokens, dtype=torch.long) for tokens, _ in examples)
    masks = tuple(torch.tensor(mask, dtype=torch.float32) for _, mask in examples)
    n_tokens = float(sum(m.sum() for m in masks))
    assert n_tokens > 0, "no trained token in the batch (no assistant turn?)"
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        num_global_tokens=n_tokens,
        num_global_seqs=float(sum(1 for m in masks if m.sum() > 0)),
        max_response_length=max(int(m.sum()) for m in masks),
    )


def tokenize_all(
    tokenizer: Any, conversations: Sequence[Sequence[Message]], limit: TokenLimit | None
) -> list[TokenizedConversation]:
    """Tokenise every conversation; those longer than `limit` are one error that names them
    (0-based, in file order) and the limit that refused them (`rollouts.data.limits`)."""
    out = [tokenize_conversation(tokenizer, messages) for messages in conversations]
    if limit is None:
        return out
    over = [(i, len(tokens)) for i, (tokens, _) in enumerate(out) if len(tokens) > limit.tokens]
    if over:
        named = ", ".join(f"conversation {i} ({n} tokens)" for i, n in over[:MAX_NAMED])
        more = f" and {len(over) - MAX_NAMED} more" if len(over) > MAX_NAMED else ""
        raise ValueError(
            f"{len(over)} SFT conversation(s) longer than {limit.tokens} tokens, the limit of "
            f"{limit.source}: {named}{more}; shorten them, drop them from data.sft_path, or "
            "raise that limit"
        )
    return out


def split_eval(
    examples: Sequence[TokenizedConversation], fraction: float, seed: int
) -> tuple[list[TokenizedConversation], list[TokenizedConversation]]:
    """A seeded held-out split: (train, eval); eval is empty when fraction is 0."""
    order = np.random.default_rng([seed, 7]).permutation(len(examples)).tolist()
    n_eval = int(len(examples) * fraction)
    if fraction > 0 and len(examples) > 1:
        n_eval = max(n_eval, 1)
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the examples of SFT step `step` (0-based): seeded per-epoch shuffles, no gaps.

    A pure function of the step, so a resumed run sees exactly the same batches.
    """
    assert num_examples >= 1, f"{num_examples=}"
    start = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        take = min(batch_size - len(out), num_examples - offset)
        out.extend(order[offset : offset + take].tolist())
    return out


def total_sft_steps(config: Config, num_train: int) -> int:
    """training.sft_steps, or sft_epochs passes over the data."""
    t = config.training
    return t.sft_steps or t.sft_epochs * math.ceil(num_train / t.sft_batch_size)


def masked_mean(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
    """The mean of `values` over the tokens whose mask is 1 (NaN with none)."""
    assert len(values) == len(masks), f"{len(values)=} != {len(masks)=}"
    total = sum(float((v * m).sum()) for v, m in zip(values, masks, strict=True))
    count = sum(float(m.sum()) for m in masks)
    return total / count if count else math.nan


async def eval_metrics(
    backend: TrainingBackend, examples: Sequence[TokenizedConversation], batch_size: int
) -> dict[str, float]:
    """`sft/eval_loss` (token-mean NLL) and `sft/eval_accuracy` (the share of trained tokens
    that are the model's argmax) of the held-out examples under the current weights."""
    logprobs: list[torch.Tensor] = []
    hits: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        batch = make_sft_batch(examples[start : start + batch_size])
        logprobs += await backend.compute_logprobs(batch)
        argmax = dataclasses.replace(batch, metadata={ARGMAX_MATCH: True})
        hits += await backend.compute_logprobs(argmax)
        masks += batch.loss_mask
    return {
        "sft/eval_loss": -masked_mean(logprobs, masks),
        "sft/eval_accuracy": masked_mean(hits, masks),
    }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTResult:
    """What an SFT run ends with."""

    steps: int
    final_loss: float
    eval_loss: float | None
    eval_accuracy: float | None = None


async def run_sft_training(
    backend: TrainingBackend,
    examples: Sequence[TokenizedConversation],
    config: Config,
    metrics_logger: StepLog,
    *,
    eval_examples: Sequence[TokenizedConversation] = (),
    start_step: int = 0,
    checkpoint: Callable[[int], Awaitable[None]] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> SFTResult:
    """Train on `examples` for `total_sft_steps` steps; eval, log and checkpoint on the way.

    With held-out examples, a fresh run evaluates them first (logged as step 0), then every
    `eval_every` steps and at the end. `checkpoint(step)` is called every `checkpoint.every`
    steps, at the end, and when `should_stop()` turns true (a signal), after which the loop
    returns.
    """
    t = config.training
    total = total_sft_steps(config, len(examples))
    loss = math.nan
    last_eval: dict[str, float] = {}
    step = start_step
    if eval_examples and start_step == 0:  # "before", so the summary shows what SFT changed
        last_eval = await eval_metrics(backend, eval_examples, t.sft_batch_size)
        metrics_logger.log(0, last_eval)
    for step in range(start_step + 1, total + 1):
        started = time.monotonic()
        idx = batch_indices(len(examples), t.sft_batch_size, step - 1, config.run.seed)
        batch = make_sft_batch([examples[i] for i in idx])
        fb = await backend.forward_backward(batch, PlainLoss(fn=sft_loss_fn))
        opt = await backend.optim_step()
        loss = fb["sft/loss"]
        metrics = {**fb, **{f"sft/{k}": v for k, v in opt.items()}}
        metrics["sft/tokens_per_s"] = batch.num_global_tokens / (time.monotonic() - started)
        eval_now = t.eval_every and step % t.eval_every == 0
        if eval_examples and (eval_now or step == total):
            last_eval = await eval_metrics(backend, eval_examples, t.sft_batch_size)
            metrics |= last_eval
        metrics["perf/step_time_s"] = time.monotonic() - started
        metrics_logger.log(step, metrics)
        every = config.checkpoint.every
        stop = should_stop()
        if checkpoint and ((every and step % every == 0) or step == total or stop):
            await checkpoint(step)
        if stop:
            break
    return SFTResult(
        steps=step,
        final_loss=loss,
        eval_loss=last_eval.get("sft/eval_loss"),
        eval_accuracy=last_eval.get("sft/eval_accuracy"),
    )
