"""Optional reward-model scoring with a local HF sequence-classification model.

`RewardModel.load(path)` reads a model saved with `save_pretrained` (as an
AutoModelForSequenceClassification with one label) and its tokenizer; `score_texts` returns
one float per text (the logit of label 0).
`reward_model_fn(rm)` is a sync `RewardFn` over samples: the scoring runner runs it in a worker
thread under its time bound, so the trio loop is never blocked by the forward pass.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rollouts.rewards.verifiers import Decode, response_text
from rollouts.types import Sample


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardModel:
    """A loaded reward model: model, tokenizer, device and truncation length."""

    model: Any
    tokenizer: Any
    device: str = "cpu"
    max_length: int = 1024
    lock: Any = dataclasses.field(default_factory=threading.Lock)  # one forward at a time

    @classmethod
    def load(cls, path: str, device: str = "cpu", max_length: int = 1024) -> RewardModel:
        """Load model and tokenizer from `path` (local files only), in eval mode."""
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, local_files_only=True
        )
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{path}: the reward model's tokenizer has no pad token; set one")
        model.config.pad_token_id = tokenizer.pad_token_id
        model.to(device).eval()
        return cls(model=model, tokenizer=tokenizer, device=device, max_length=max_length)

    def score_texts(self, texts: Sequence[str], batch_size: int = 8) -> list[float]:
        """One score per text (batched, right-padded, truncated to `max_length`)."""
        assert batch_size >= 1, f"{batch_size=} must be >= 1"
        scores: list[float] = []
        with self.lock, torch.no_grad():
            for start in range(0, len(texts), batch_size):
                chunk = list(texts[start : start + batch_size])
                enc = self.tokenizer(
                    chunk,
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                ).to(self.device)
                logits = self.model(**enc).logits
                assert logits.shape == (len(chunk), 1), f"{logits.shape=}: expected one label"
                scores.extend(float(x) for x in logits[:, 0].float().cpu())
        return scores


def prompt_text(sample: Sample) -> str:
    """The prompt as text: the string, or the chat messages' contents joined by newlines."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    return "\n".join(str(m.get("content", "")) for m in sample.prompt)


def reward_model_fn(
    rm: RewardModel,
    decode: Decode | None = None,
    text_fn: Callable[[Sample], str] | None = None,
) -> Callable[[Sample], float]:
    """A sync reward function scoring prompt + response text (or `text_fn(sample)`) with `rm`."""

    def reward(sample: Sample) -> float:
        text = text_fn(sample) if text_fn else prompt_text(sample) + response_text(sample, decode)
        return rm.score_texts([text])[0]

    return reward
