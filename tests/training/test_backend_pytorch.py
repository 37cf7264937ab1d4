"""PyTorchBackend on CPU with the tiny model: overfitting, micro-batching, logprobs, guards."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch

from rollouts.config import Config
from rollouts.trainer.batching import padding_fraction, plan_micro_batches
from rollouts.trainer.factories import create_pytorch_backend, warmup_cosine_factor
from rollouts.trainer.model import LOGITS_CHUNK_BYTES, auto_chunk_size
from rollouts.trainer.protocol import NonFiniteError, TrainingBackend
from rollouts.types import FULL_PRECISION, ModelOutputs, PlainLoss, TrainBatch
from tests.training.backend_helpers import (
    LENGTHS,
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)


def test_plans_cover_every_sequence_once_and_respect_the_budget() -> None:
    for layout in ("pad", "pack"):
        plans = plan_micro_batches(LENGTHS, 16, layout)
        seen = sorted(i for p in plans for i in p.indices)
        assert seen == list(range(len(LENGTHS)))
        assert all(p.padded_tokens <= 16 or len(p.indices) == 1 for p in plans)
    assert padding_fraction(plan_micro_batches(LENGTHS, 16, "pack"), LENGTHS) == 0.0
    pad = plan_micro_batches([4, 4, 2, 2], 8, "pad")
    assert [p.indices for p in pad] == [(0, 1), (2, 3)]
    assert padding_fraction(plan_micro_batches([4, 2], 8, "pad"), [4, 2]) == pytest.approx(0.25)


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [warmup_cosine_factor(s, 2, 10, 0.1) for s in range(12)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))


def test_backend_overfits_a_tiny_batch_and_reports_padding(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(
        tiny_config(tiny_model_dir, micro_batch_tokens=24), total_steps=40
    )
    assert isinstance(backend, TrainingBackend)
    batch = make_batch(LENGTHS)
    losses = []
    for _ in range(40):
        metrics = backend.forward_backward(batch, nll_loss).result()
        step = backend.optim_step().result()
        losses.append(metrics["loss"])
    backend.close()
    assert losses[-1] <= 0.1 * losses[0], f"{losses[0]=} {losses[-1]=}"
    assert metrics["nll"] == pytest.approx(metrics["loss"])
    assert metrics["num_micro_batches"] > 1  # gradient accumulation ran
    expected = padding_fraction(plan_micro_batches(LENGTHS, 24, "pad"), LENGTHS)
    assert metrics["padding_fraction"] == pytest.approx(expected)
    assert 0.0 < metrics["padding_fraction"] < 0.5
    assert metrics["num_tokens"] == sum(LENGTHS)
    assert step["grad_norm"] > 0 and step["skipped"] == 0.0 and step["optim_steps"] == 40


def _reference_logprobs(lm: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = lm(ids[None]).logits[0].float().log_softmax(-1)
    return torch.cat([torch.zeros(1), logits[:-1].gather(-1, ids[1:, None])[:, 0]])


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_logprobs_do_not_depend_on_the_micro_batch(tiny_model_dir: Path, layout: str) -> None:
    batch = make_batch(LENGTHS, seed=1)
    config = tiny_config(tiny_model_dir, micro_batch_layout=layout, logprob_chunk_size=5)
    by_budget = []
    for budget in (12, 25, 1000):
        backend = create_pytorch_backend(
            dataclasses.replace(
                config, training=dataclasses.replace(config.training, micro_batch_tokens=budget)
            )
        )
        by_budget.append(backend.compute_logprobs(batch).result())
        lm = backend.lm
        backend.close()
    for ids, lp in zip(batch.input_ids, by_budget[0], strict=True):
        assert lp.shape == ids.shape and lp[0] == 0.0
        torch.testing.assert_close(lp, _reference_logprobs(lm, ids), atol=1e-5, rtol=1e-5)
    for other in by_budget[1:]:
        for a, b in zip(by_budget[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_is_computed_when_asked(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir, logprob_chunk_size=4))
    seen: dict[str, ModelOutputs] = {}

    def loss_fn(outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        seen["out"] = outputs
        return nll_loss(outputs, batch)

    backend.forward_backward(make_batch([6, 4]), PlainLoss(fn=loss_fn), entropy=True).result()
    backend.close()
    out = seen["out"]
    vocab = backend.lm.config.vocab_size
    for lp, ent in zip(out.logprobs, out.entropy, strict=True):
        assert ent.shape == lp.shape and ent[0] == 0.0
        assert (ent[1:] > 0).all() and (ent[1:] <= math.log(vocab) + 1e-4).all()


def test_auto_chunk_size_keeps_a_chunk_of_logits_under_512_mib() -> None:
    assert auto_chunk_size(49152) == 2730  # SmolLM2
    assert auto_chunk_size(151936) == 883  # Qwen2
    n = auto_chunk_size(260)  # a tiny model: one chunk for any micro-batch it trains
    assert n * 260 * 4 <= LOGITS_CHUNK_BYTES < (n + 1) * 260 * 4 and n > 500_000


def test_an_entropy_metric_has_no_graph_and_the_same_value(tiny_model_dir: Path) -> None:
    """A loss that does not train on the entropy (PolicyLoss.needs_entropy false) gets it
    detached, with the value a trained one has; the logprobs keep their graph either way."""
    seen: dict[bool, ModelOutputs] = {}

    class Loss:
        needs_values = False

        def __init__(self, needs: bool) -> None:
            self.needs_entropy = needs

        def __call__(self, outputs: ModelOutputs, batch: TrainBatch):
            seen[self.needs_entropy] = outputs
            return nll_loss(outputs, batch)

    for needs in (False, True):
        backend = create_pytorch_backend(tiny_config(tiny_model_dir, logprob_chunk_size=4))
        backend.forward_backward(make_batch([6, 4]), Loss(needs), entropy=True).result()
        backend.close()
    assert all(not e.requires_grad for e in seen[False].entropy)
    assert all(e.requires_grad for e in seen[True].entropy)
    assert all(lp.requires_grad for out in seen.values() for lp in out.logprobs)
    for a, b in zip(seen[False].entropy, seen[True].entropy, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_nonfinite_steps_are_skipped_then_stop_the_run(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir, max_consecutive_nonfinite=2))
    before = backend.get_weights()
    batch = make_batch([5, 4])

    def nan_nll(outputs: ModelOutputs, b: TrainBatch) -> tuple[torch.Tensor, dict]:
        loss, metrics = nll_loss(outputs, b)
        return loss * float("nan"), metrics

    nan_loss = PlainLoss(fn=nan_nll)

    metrics = backend.forward_backward(batch, nan_loss).result()
    assert metrics["nonfinite_micro_batches"] == 1.0
    step = backend.optim_step().result()
    assert step["skipped"] == 1.0 and step["steps_skipped_total"] == 1.0
    after = backend.get_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    backend.forward_backward(batch, nll_loss).result()
    assert backend.optim_step().result()["skipped"] == 0.0  # a good step resets the count
    backend.forward_backward(batch, nan_loss).result()
    backend.optim_step().result()
    backend.forward_backward(batch, nan_loss).result()
    with pytest.raises(NonFiniteError, match="max_consecutive_nonfinite = 2"):
        backend.optim_step().result()
    backend.close()


def _gradients(config: Config) -> dict[str, torch.Tensor]:
    backend = create_pytorch_backend(config)
    backend.forward_backward(make_batch(LENGTHS, seed=2), nll_loss).result()
    grads = {n: p.grad.clone() for n, p in backend.lm.named_parameters()}
    backend.close()
    return grads


def test_layouts_chunking_and_activation_checkpointing_give_the_same_gradient(
    tiny_model_dir: Path,
) -> None:
    base = tiny_config(tiny_model_dir, micro_batch_tokens=1000)
    expected = _gradients(base)
    variants = [
        tiny_config(tiny_model_dir, micro_batch_tokens=13, micro_batch_layout="pack"),
        tiny_config(tiny_model_dir, micro_batch_tokens=20, logprob_chunk_size=3),
        dataclasses.replace(
            base, model=dataclasses.replace(base.model, gradient_checkpointing=True)
        ),
    ]
    for config in variants:
        got = _gradients(config)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-4)


def test_compiled_decoder_layers_give_the_same_gradients_and_weight_names(
    tiny_model_dir: Path,
) -> None:
    """model.compile = true: the same gradients over micro-batches of several shapes, the same
    parameter names (checkpoints, weight sync), and each layer's forward is the compiled one."""
    base = tiny_config(tiny_model_dir, micro_batch_tokens=20)
    expected = _gradients(base)
    compiled = dataclasses.replace(base, model=dataclasses.replace(base.model, compile=True))
    backend = create_pytorch_backend(compiled)
    layers = backend.lm.get_decoder().layers
    assert all(getattr(layer.forward, "_torchdynamo_orig_callable", None) for layer in layers)
    for seed in (2, 2):  # the second pass runs the cached graphs
        backend.lm.zero_grad(set_to_none=True)
        backend.forward_backward(make_batch(LENGTHS, seed=seed), nll_loss).result()
        got = {n: p.grad.clone() for n, p in backend.lm.named_parameters()}
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-4)
    assert set(backend.get_weights()) == set(expected)
    backend.close()


def test_compile_without_a_cxx_compiler_is_a_clear_error(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tiny_config(tiny_model_dir)
    compiled = dataclasses.replace(base, model=dataclasses.replace(base.model, compile=True))
    monkeypatch.setattr("rollouts.trainer.building.shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"model.compile = true: .* set model.compile = false"):
        create_pytorch_backend(compiled)


def test_bf16_autocast_on_cpu_runs_the_model_in_bf16_and_keeps_fp32_weights(
    tiny_model_dir: Path,
) -> None:
    """training.autocast = "bfloat16" on CPU: logprobs near the fp32 ones but not equal (the
    matmuls ran in bf16), the weights and the gradient step stay fp32, and it trains."""
    batch = make_batch(LENGTHS, seed=1)
    out = {}
    for mode in ("off", "bfloat16"):
        backend = create_pytorch_backend(tiny_config(tiny_model_dir, autocast=mode))
        out[mode] = backend.compute_logprobs(batch).result()
        # the weight sync's probe asks for the master weights' precision: no autocast
        exact = dataclasses.replace(batch, metadata={FULL_PRECISION: True})
        out[f"{mode} exact"] = backend.compute_logprobs(exact).result()
        losses = []
        for _ in range(3):
            losses.append(backend.forward_backward(batch, nll_loss).result()["loss"])
            backend.optim_step().result()
        assert all(p.dtype == torch.float32 for p in backend.lm.parameters())
        assert losses[-1] < losses[0], (mode, losses)
        backend.close()
    gaps = [float((a - b).abs().max()) for a, b in zip(out["off"], out["bfloat16"], strict=True)]
    assert 1e-4 < max(gaps) < 0.25, gaps
    for a, b in zip(out["off"], out["bfloat16 exact"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
