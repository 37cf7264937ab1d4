"""Logprobs (and entropy) of chosen tokens from logits, forward and backward in row blocks.

`logit_stats(logits_N_V, ids_N_K, want_entropy, entropy_grad)` gives the float32 logprobs of
`ids_N_K` under each row's softmax and, with `want_entropy`, the row's entropy: what the trainer
reads from the LM head. It is a `torch.autograd.Function` because autograd through
`log_softmax(logits.float()).gather(...)` walks the whole [N, V] tensor eight times in all (the
float copy, log_softmax, the gather's zero-filled gradient and its scatter, log_softmax's
backward, the cast back) and keeps a float32 [N, V] alive for the backward pass. Here each block
of rows (a few MiB of float32) is read while it stays in the CPU's cache, the backward pass
recomputes the softmax from the saved logits and each row's log-sum-exp, and writes the
gradient once, in the logits' dtype:

    d logp(id_k) / d x_j = [j == id_k] - p_j          d H / d x_j = -p_j (logp_j + H)

On SmolLM2's head (49k vocabulary, 2048 tokens, two cores) the time beyond its matmuls went
from 0.51 to 0.15 s, and from 0.83 to 0.22 s with an entropy metric
(`scripts/bench_logit_stats.py`). On a GPU a block is every row: the gain there is the float32
[N, V] no longer kept for the backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

BLOCK_BYTES = 4 * 2**20  # float32 logits a block of rows holds on CPU (kept in cache)


def block_rows(vocab_size: int, device_type: str) -> int:
    """Rows per block: a few MiB of float32 logits on CPU (cache-sized: 21 rows of SmolLM2's
    49k vocabulary), every row at once elsewhere (one kernel per operation on a GPU)."""
    if device_type != "cpu":
        return 1 << 62
    return max(1, BLOCK_BYTES // (4 * vocab_size))


class _LogitStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits_N_V: torch.Tensor, ids_N_K: torch.Tensor, want_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits_N_V.shape[0]
        rows = block_rows(logits_N_V.shape[1], logits_N_V.device.type)
        f32 = {"dtype": torch.float32, "device": logits_N_V.device}
        lp_N_K = torch.empty(ids_N_K.shape, **f32)
        lse_N = torch.empty(n, **f32)
        ent_N = torch.zeros(n, **f32)
        with torch.autocast(logits_N_V.device.type, enabled=False):
            for s in range(0, n, rows):
                x = logits_N_V[s : s + rows].float()
                logp = F.log_softmax(x, dim=-1)
                lp_N_K[s : s + rows] = logp.gather(-1, ids_N_K[s : s + rows])
                # log-sum-exp from the row's largest logit, whose logprob is near 0: exact to
                # float32's rounding (a very negative logprob would lose digits)
                lse_N[s : s + rows] = x.amax(-1) - logp.amax(-1)
                if want_entropy:
                    ent_N[s : s + rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits_N_V, ids_N_K, lse_N, ent_N)
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, not zeros
        return lp_N_K, ent_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_lp_N_K: torch.Tensor | None, grad_ent_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None]:
        logits_N_V, ids_N_K, lse_N, ent_N = ctx.saved_tensors
        n = logits_N_V.shape[0]
        rows = block_rows(logits_N_V.shape[1], logits_N_V.device.type)
        if grad_lp_N_K is None:
            grad_lp_N_K = torch.zeros(ids_N_K.shape, dtype=torch.float32, device=lse_N.device)
        grad_lp_N_K = grad_lp_N_K.float()
        sum_N_1 = grad_lp_N_K.sum(-1, keepdim=True)
        grad_N_V = torch.empty_like(logits_N_V)
        for s in range(0, n, rows):
            e = s + rows
            logp = logits_N_V[s:e].float().sub_(lse_N[s:e, None])
            p = logp.exp()
            if grad_ent_N is None:
                g = p.mul_(-sum_N_1[s:e])
            else:  # -p (logp + H) gH - p sum_k(g_k)
                g_ent = grad_ent_N[s:e, None].float()
                g = logp.add_(ent_N[s:e, None]).mul_(g_ent).add_(sum_N_1[s:e]).mul_(p).neg_()
            g.scatter_add_(-1, ids_N_K[s:e], grad_lp_N_K[s:e])
            grad_N_V[s:e] = g
        return grad_N_V, None, None


def logit_stats(
    logits_N_V: torch.Tensor, ids_N_K: torch.Tensor, want_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float32 logprobs of `ids_N_K` and [N] entropies (zeros without `want_entropy`;
    detached without `entropy_grad`: a metric). Gradients flow to `logits_N_V` in its dtype."""
    assert logits_N_V.dim() == 2 and ids_N_K.dim() == 2, f"{logits_N_V.shape=} {ids_N_K.shape=}"
    assert ids_N_K.shape[0] == logits_N_V.shape[0], f"{ids_N_K.shape=} {logits_N_V.shape=}"
    lp_N_K, ent_N = _LogitStats.apply(logits_N_V, ids_N_K, want_entropy)
    if not (want_entropy and entropy_grad):
        ent_N = ent_N.detach()
    return lp_N_K, ent_N
