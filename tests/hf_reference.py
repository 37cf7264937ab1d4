"""Reference outputs of an HF model computed in the test process, for the engine's and the
clients' tests to compare what a server returns with."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """`model.generate(do_sample=False)` continuation of one prompt."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, attention_mask=None
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]):
    """log p(output[t] | prompt + output[:t]) from one forward pass."""
    full = torch.tensor([prompt + output])
    logits = model(full).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]
