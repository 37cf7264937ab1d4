"""The LM head's softmax statistics in row blocks (rollouts/trainer/logit_stats.py) against
autograd through `log_softmax(logits.float())`: values and gradients, in float32 and bfloat16,
with top-k ids, an entropy that is trained and one that is only a metric."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollouts.trainer import logit_stats as ls


def reference(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, ids), -(logp.exp() * logp).sum(-1)


def grads(
    fn, logits: torch.Tensor, ids: torch.Tensor, w_lp: torch.Tensor, w_ent: torch.Tensor | None
):
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x, ids)
    loss = (lp * w_lp).sum() + (0.0 if w_ent is None else (ent * w_ent).sum())
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_autograd(
    dtype: torch.dtype, entropy_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ls, "BLOCK_BYTES", 4 * 300 * 3)  # 3 rows a block: 13 rows end mid-block
    gen = torch.Generator().manual_seed(0)
    n, v, k = 13, 300, 4
    logits = (torch.randn(n, v, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, v, (n, k), generator=gen)
    ids[0, 1] = ids[0, 0]  # the same id twice in a row: both gradients land on it
    w_lp = torch.randn(n, k, generator=gen)
    w_ent = torch.randn(n, generator=gen) if entropy_grad else None

    def ours(x, i):
        return ls.logit_stats(x, i, True, entropy_grad)

    def ref(x, i):
        lp, ent = reference(x, i)
        return lp, ent if entropy_grad else ent.detach()

    lp, ent, gx = grads(ours, logits, ids, w_lp, w_ent)
    lp_r, ent_r, gx_r = grads(ref, logits, ids, w_lp, w_ent)
    assert lp.dtype == ent.dtype == torch.float32 and gx.dtype == dtype
    torch.testing.assert_close(lp, lp_r, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ent_r, atol=2e-5, rtol=0)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the gradient's own rounding
    torch.testing.assert_close(gx.float(), gx_r.float(), atol=tol, rtol=tol)
    assert gx.abs().sum() > 0


def test_an_untrained_entropy_is_zero_and_detached_and_extreme_logits_stay_finite() -> None:
    logits = torch.tensor([[0.0, 80.0, -80.0, 3.0], [1e4, -1e4, 0.0, 0.0]], requires_grad=True)
    ids = torch.tensor([[2], [1]])
    lp, ent = ls.logit_stats(logits, ids, False, False)
    assert not ent.requires_grad and torch.equal(ent, torch.zeros(2))
    lp_r, _ = reference(logits, ids)
    torch.testing.assert_close(lp, lp_r, atol=1e-4, rtol=1e-6)
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()
    g_r = torch.autograd.grad(reference(logits, ids)[0].sum(), logits)[0]
    torch.testing.assert_close(logits.grad, g_r, atol=1e-6, rtol=0)


def test_blocks_fit_a_cpu_cache_and_span_every_row_elsewhere() -> None:
    assert ls.block_rows(49152, "cpu") == 21  # SmolLM2: 4 MiB of float32 a block
    assert ls.block_rows(10**8, "cpu") == 1
    assert ls.block_rows(49152, "cuda") >= 2**40
