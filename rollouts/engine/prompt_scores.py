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


def score_prompt(model: Any, prompt_ids: list[int], top: int) -> list[PromptLogprob]:
    """Each prompt token's logprob given the tokens before it (raw logits, as vLLM's and
    SGLang's prompt logprobs), its rank, and the top `top` candidates: one forward of `model`,
    without a KV cache. Position 0 has no entry."""
    assert len(prompt_ids) >= 1, "an empty prompt"
    assert top >= 0, f"{top=}"
    device = next(model.parameters()).device
    ids_T = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    with torch.inference_mode(), precision.context(model):
        logits_T_V = model(input_ids=ids_T[None]).logits[0, :-1].float()
    logprobs_T_V = torch.log_softmax(logits_T_V, dim=-1)
    targets_T = ids_T[1:]
    chosen_T = logprobs_T_V.gather(1, targets_T[:, None]).squeeze(1)
    ranks_T = (logprobs_T_V > chosen_T[:, None]).sum(dim=1) + 1
    tops = torch.topk(logprobs_T_V, top, dim=-1) if top else None
    out = []
    for t in range(len(prompt_ids) - 1):
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
