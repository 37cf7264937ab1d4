from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.config import config_from_dict
from rollouts.data.limits import TokenLimit, model_context
from rollouts.data.loaders import write_jsonl
from rollouts.driver.metrics import JsonlSink, MetricsLogger
from rollouts.driver.setup import StopFlag
from rollouts.driver.sft_phase import sft_phase
from rollouts.driver.summary import finish_run, phase_line, summarize_phase
from rollouts.loop.sft import (
    batch_indices,
    eval_metrics,
    make_sft_batch,
    run_sft_training,
    sft_loss_fn,
    split_eval,
    tokenize_all,
    total_sft_steps,
)
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import ModelOutputs

CONVERSATIONS = [
    (
        {"role": "user", "content": f"{a}+{b}"},
        {"role": "assistant", "content": f"Answer: {a + b}"},
    )
    for a, b in [(12, 30), (45, 11), (70, 22), (33, 33), (18, 61), (52, 27)]
]


def test_batch_indices_are_a_pure_function_of_the_step() -> None:
    steps = [batch_indices(5, 2, s, seed=1) for s in range(5)]
    flat = [i for b in steps for i in b]
    assert sorted(flat[:5]) == list(range(5))  # epoch 0 is a permutation
    assert sorted(flat[5:10]) == list(range(5))  # epoch 1 too, crossing the step boundary
    assert batch_indices(5, 2, 3, seed=1) == steps[3]  # resume at step 3 sees the same batch


def test_split_eval_is_seeded_and_disjoint() -> None:
    examples = [([i], [1]) for i in range(20)]
    train, held = split_eval(examples, 0.1, seed=0)
    assert len(held) == 2 and len(train) == 18
    assert not {e[0][0] for e in held} & {e[0][0] for e in train}
    assert split_eval(examples, 0.1, seed=0) == (train, held)
    assert split_eval(examples, 0.0, seed=0)[1] == []


def test_sft_loss_is_normalised_by_the_global_token_count() -> None:
    batch = make_sft_batch([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])])
    assert batch.num_global_tokens == 3.0
    lp = (torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -3.0]))
    whole, _ = sft_loss_fn(ModelOutputs(logprobs=lp), batch)
    assert whole.item() == pytest.approx((1 + 2 + 3) / 3)
    parts = [sft_loss_fn(ModelOutputs(logprobs=(lp[i],)), batch.select([i]))[0] for i in (0, 1)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item())  # micro-batches add up


async def test_held_out_accuracy_is_the_share_of_trained_tokens_the_model_argmaxes(
    tiny_model_dir: Path,
) -> None:
    """After 3 SFT steps (some tokens right, not all), `sft/eval_accuracy` through the backend
    (in batches of 4) equals the argmax of the HF model's own logits (the same weights) counted
    over the loss-masked tokens; the loss beside it is their mean NLL."""
    config = config_from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            "training": {"sft_steps": 3, "sft_batch_size": 4},
            "optim": {"lr": 3e-3, "scheduler": "constant"},
        }
    )
    examples = tokenize_all(AutoTokenizer.from_pretrained(tiny_model_dir), CONVERSATIONS, None)
    backend = create_pytorch_backend(config, total_steps=3)
    try:
        await run_sft_training(backend, examples, config, MetricsLogger([]))
        got = await eval_metrics(backend, examples, batch_size=4)
        weights = backend.get_weights()
    finally:
        backend.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    hits, nll, trained = 0, 0.0, 0
    for tokens, mask in examples:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].float()
        targets, m = torch.tensor(tokens[1:]), torch.tensor(mask[1:]).bool()
        hits += int((logits.argmax(-1) == targets)[m].sum())
        nll -= float(logits.log_softmax(-1).gather(-1, targets[:, None])[m].sum())
        trained += int(m.sum())
    assert 0 < trained == sum(sum(mask) for _, mask in examples)
    assert 0 < hits < trained, (hits, trained)  # neither nothing nor everything right
    assert got["sft/eval_accuracy"] == hits / trained, (hits, trained)
    assert got["sft/eval_loss"] == pytest.approx(nll / trained, rel=1e-5)


def test_long_conversation_is_a_clear_error(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    limit = TokenLimit(tokens=5, source="data.max_length = 5")
    with pytest.raises(ValueError, match=r"1 SFT conversation\(s\) longer than 5 tokens, the "):
        tokenize_all(tok, CONVERSATIONS[:1], limit)


def _sft_config(tmp: Path, model: Path, long_chars: int, **data: object) -> Any:
    rows = [{"messages": list(c)} for c in CONVERSATIONS]
    long = {"role": "assistant", "content": "7" * long_chars}
    rows.insert(2, {"messages": [{"role": "user", "content": "1+1"}, long]})
    write_jsonl(tmp / "sft.jsonl", rows)
    table = {
        "run": {"output_dir": str(tmp / "run")},
        "model": {"path": str(model)},
        "data": {"sft_path": str(tmp / "sft.jsonl"), "sft_eval_fraction": 0.0, **data},
        "training": {"sft_steps": 1, "sft_batch_size": 2},
    }
    return config_from_dict(table)


async def test_sft_refuses_what_the_model_positions_cannot_hold_and_names_the_limit(
    tmp_path: Path,
) -> None:
    """A 128-position model whose tokenizer says model_max_length = 1,000,000: a 300-token
    conversation used to train without a word (issue 27 item 5)."""
    spec = TinyModelSpec(
        hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=128
    )
    model = make_tiny_model(tmp_path / "m128", spec)
    assert AutoTokenizer.from_pretrained(model).model_max_length == 1_000_000
    config = _sft_config(tmp_path, model, long_chars=300)
    with pytest.raises(ValueError) as info:
        await sft_phase(config, tmp_path / "run", model, False, StopFlag())
    message = str(info.value)
    assert "1 SFT conversation(s) longer than 128 tokens" in message, message
    assert f"model.max_position_embeddings = 128 ({model}/config.json)" in message, message
    assert "conversation 2 (" in message, message  # 0-based, in file order
    # data.max_length, when tighter, is the limit named
    config = _sft_config(tmp_path, model, long_chars=80, max_length=64)
    with pytest.raises(ValueError, match=r"longer than 64 tokens, the limit of data.max_length"):
        await sft_phase(config, tmp_path / "run", model, False, StopFlag())


async def test_sft_loop_lowers_the_loss_and_checkpoints(tiny_model_dir: Path) -> None:
    config = config_from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            "training": {"sft_steps": 30, "sft_batch_size": 4, "eval_every": 10},
            "optim": {"lr": 3e-3, "scheduler": "constant"},
            "checkpoint": {"every": 10},
        }
    )
    backend = create_pytorch_backend(config, total_steps=30)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = tokenize_all(tok, CONVERSATIONS, model_context(tiny_model_dir))
    train, held = split_eval(examples, 0.2, seed=0)
    assert total_sft_steps(config, len(train)) == 30
    logger = MetricsLogger([])
    saved: list[int] = []

    async def checkpoint(step: int) -> None:
        saved.append(step)

    try:
        result = await run_sft_training(
            backend, train, config, logger, eval_examples=held, checkpoint=checkpoint
        )
    finally:
        backend.close()
    losses = [row["sft/loss"] for row in logger.history if "sft/loss" in row]
    assert result.steps == 30
    assert losses[-1] < 0.5 * losses[0]
    assert [row["step"] for row in logger.history if "sft/eval_loss" in row] == [0, 10, 20, 30]
    accuracy = [row["sft/eval_accuracy"] for row in logger.history if "sft/eval_loss" in row]
    assert accuracy[-1] > accuracy[0] and result.eval_accuracy == accuracy[-1], accuracy
    assert saved == [10, 20, 30]


async def test_eval_every_0_evaluates_before_training_so_the_summary_shows_a_change(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The summary once read "held-out loss 0.779 -> 0.779" (one evaluation, at the end)."""
    config = config_from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            "training": {"sft_steps": 6, "sft_batch_size": 4, "eval_every": 0},
            "optim": {"lr": 3e-3, "scheduler": "constant"},
        }
    )
    backend = create_pytorch_backend(config, total_steps=6)
    examples = tokenize_all(AutoTokenizer.from_pretrained(tiny_model_dir), CONVERSATIONS, None)
    logger = MetricsLogger([JsonlSink(tmp_path / "sft_metrics.jsonl")])
    try:
        result = await run_sft_training(
            backend, examples[2:], config, logger, eval_examples=examples[:2]
        )
    finally:
        backend.close()
        logger.close()
    evals = [
        (row["step"], row["sft/eval_loss"]) for row in logger.history if "sft/eval_loss" in row
    ]
    assert [step for step, _ in evals] == [0, 6]
    assert evals[1][1] < evals[0][1] and result.eval_loss == evals[1][1]
    line = finish_run(tmp_path, 1.0, None)[0]
    assert line == f"SFT: 6 steps; held-out loss {evals[0][1]:.3f} -> {evals[1][1]:.3f}", line


def test_a_single_late_evaluation_is_not_shown_as_before_and_after() -> None:
    rows = [{"step": 1, "sft/loss": 2.0}, {"step": 6, "sft/loss": 1.0, "sft/eval_loss": 0.779}]
    p = summarize_phase("SFT", rows, "sft/eval_loss", higher_is_better=False)
    assert p is not None and p.before is None
    line = phase_line(p, "held-out loss", None)
    assert line == "SFT: 6 steps; held-out loss 0.779 (no evaluation before training)", line


@pytest.mark.parametrize(("sft_autocast", "trains_with"), [("", "bfloat16"), ("off", "off")])
async def test_sft_trains_with_sft_autocast_and_rl_keeps_autocast(
    tiny_model_dir: Path, tmp_path: Path, sft_autocast: str, trains_with: str
) -> None:
    """training.sft_autocast sets the SFT phase's autocast alone ("" = training.autocast)."""
    rows = [{"messages": list(c)} for c in CONVERSATIONS]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    table = {
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_model_dir)},
        "data": {"sft_path": str(tmp_path / "sft.jsonl"), "sft_eval_fraction": 0.0},
        "training": {
            "sft_steps": 1,
            "sft_batch_size": 2,
            "autocast": "bfloat16",
            "sft_autocast": sft_autocast,
        },
    }
    config = config_from_dict(table)
    built: list[bool] = []

    def recording_backend(cfg: Any, **kwargs: Any) -> Any:
        backend = create_pytorch_backend(cfg, **kwargs)
        built.append(backend.core.settings.autocast_dtype is not None)
        return backend

    await sft_phase(config, tmp_path / "run", tiny_model_dir, False, StopFlag(), recording_backend)
    assert built == [trains_with == "bfloat16"]
    assert config.training.autocast == "bfloat16"  # the RL phase's section is unchanged
