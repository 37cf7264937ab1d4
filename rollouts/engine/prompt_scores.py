"""The prompt logprobs the built-in engine serves: each prompt token's logprob given the tokens
before it, from one forward of the served weights (what a weight sync's content check compares
with the trainer's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rollouts.engine import precision


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PromptLogprob:
    """One prompt position: its token, that token's logprob and rank, the top candidates."""

    token: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[float, int], ...] = ()  # (logprob, token), most likely first


def score_prompt(
    model: Any, prompt_ids: list[int], top: int, start: int = 1
) -> list[PromptLogprob]:
    """The logprob of each prompt token from position `start` on (>= 1) given the tokens before
    it (raw logits, as vLLM's and SGLang's prompt logprobs), its rank, and the top `top`
    candidates: one forward of `model`, without a KV cache, its LM head and softmax only on the
    positions asked for (a teacher scoring a response asks for its tokens alone: the prompt's
    positions cost no head, no softmax over the vocabulary and no top-k)."""
    assert len(prompt_ids) >= 1, "an empty prompt"
    assert top >= 0, f"{top=}"
    assert 1 <= start <= max(len(prompt_ids), 1), f"{start=} for {len(prompt_ids)} tokens"
    device = next(model.parameters()).device
    ids_T = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    # the positions predicting tokens start.. (HF's `logits_to_keep` as indices: as an int it
    # made a 52-token SmolLM2 forward 1.7x slower on CPU, transformers 5.17)
    keep_T = torch.arange(start - 1, len(prompt_ids) - 1, device=device)
    with torch.inference_mode(), precision.context(model):
        logits_T_V = model(input_ids=ids_T[None], logits_to_keep=keep_T).logits[0].float()
    logprobs_T_V = torch.log_softmax(logits_T_V, dim=-1)
    targets_T = ids_T[start:]
    chosen_T = logprobs_T_V.gather(1, targets_T[:, None]).squeeze(1)
    ranks_T = (logprobs_T_V > chosen_T[:, None]).sum(dim=1) + 1
    tops = torch.topk(logprobs_T_V, top, dim=-1) if top else None
    out = []
    for t in range(len(targets_T)):
        best = (
            ()
            if tops is None
            else tuple(zip(tops.values[t].tolist(), tops.indices[t].tolist(), strict=True))
        )
        out.append(
            PromptLogprob(
                token=int(targets_T[t]),
                logprob=float(chosen_T[t]),
                rank=int(ranks_T[t]),
                top=best,
            )
        )
    return out
