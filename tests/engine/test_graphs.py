"""The engine's decode step as CUDA graphs (`graphs.py`): a batch of b rows runs the padded
step of the smallest captured size >= b over every cache column. On CPU the padded steps run
uncaptured (`StepGraphs(capture=False)`: the same padding, masks and write column) and must give
the unpadded step's tokens and logprobs while rows join, finish, move between slots and the
cache moves left and grows; on a GPU the captured graphs must give them too, and capture again
after the weights move (a sleep) or the cache is reallocated."""

from __future__ import annotations

import random

import pytest
import torch

from rollouts.engine import graphs, kv
from tests.engine.batch_driver import greedy_through_batch, random_workload
from tests.gqa_models import llama_gqa, qwen2


def run_batch(
    model, tokenizer, prompts, lengths, step, max_batch: int, cache_blocks: bool = False
) -> tuple[list, list]:
    """Greedy outputs and logprobs through `max_batch` slots, prompts admitted a random number
    at a time, the decode step replaced by `step` unless None."""
    out, lp, _ = greedy_through_batch(
        model,
        tokenizer,
        prompts,
        lengths,
        max_batch=max_batch,
        step=step,
        admit_rng=random.Random(0),
        cache_blocks=cache_blocks,
    )
    return out, lp


def workload(seed: int, count: int = 14) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1-30 tokens, 1-40 new tokens each: enough steps for the shared timeline to
    reach the cache's end, so it moves left or grows."""
    return random_workload(seed, count, max_new=40)


@pytest.fixture(scope="module")
def models(ref_model, tokenizer) -> dict[str, torch.nn.Module]:
    vocab = len(tokenizer)
    return {"llama": ref_model, "llama-gqa-tied": llama_gqa(vocab), "qwen2": qwen2(vocab)}


def test_graph_sizes_cover_every_batch() -> None:
    assert graphs.graph_sizes(5) == [1, 2, 4, 5]
    assert graphs.graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes = graphs.graph_sizes(256)
    assert sizes[-1] == 256 and 128 in sizes and 160 in sizes
    for b in range(1, 257):  # a batch is padded by at most 7 rows or about a third of it
        size = next(s for s in sizes if s >= b)
        assert size - b <= b // 3 + 7, (b, size)


@pytest.mark.parametrize("name", ["llama", "llama-gqa-tied", "qwen2"])
def test_the_padded_step_gives_the_unpadded_steps_tokens_and_logprobs(models, tokenizer, name):
    model = models[name]
    prompts, lengths = workload(seed=len(name))
    want_out, want_lp = run_batch(model, tokenizer, prompts, lengths, None, max_batch=5)
    step = graphs.StepGraphs(5, capture=False)
    out, lp = run_batch(model, tokenizer, prompts, lengths, step, max_batch=5)
    assert out == want_out
    for a, b in zip(lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert set(step.graphs) == {1, 2, 4, 5}, "every padded size ran"


def test_padding_rows_and_a_cache_moved_left_change_nothing(ref_model, tokenizer) -> None:
    """Many short rows through 5 slots, so the timeline moves left inside the cache (the
    columns right of the new end must be masked again: a padded step reads every column)."""
    prompts, lengths = workload(seed=11, count=40)
    lengths = [min(n, 12) for n in lengths]
    want_out, want_lp = run_batch(ref_model, tokenizer, prompts, lengths, None, max_batch=5)
    step = graphs.StepGraphs(5, capture=False)
    out, lp = run_batch(ref_model, tokenizer, prompts, lengths, step, max_batch=5)
    assert out == want_out
    for a, b in zip(lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_the_padded_step_over_small_cache_blocks_changes_nothing(
    ref_model, tokenizer, monkeypatch
) -> None:
    """The padded step writes its column by block and offset (device tensors): with the cache
    in blocks of 8 columns it gives the unpadded step's tokens and logprobs (one block)."""
    prompts, lengths = workload(seed=13)
    want_out, want_lp = run_batch(ref_model, tokenizer, prompts, lengths, None, max_batch=5)
    monkeypatch.setattr(kv, "BLOCK_COLS", 8)
    step = graphs.StepGraphs(5, capture=False)
    out, lp = run_batch(
        ref_model, tokenizer, prompts, lengths, step, max_batch=5, cache_blocks=True
    )
    assert out == want_out
    for a, b in zip(lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_on_a_gpu_give_the_eager_steps_tokens(ref_model, tokenizer) -> None:
    model = ref_model.to("cuda")
    try:
        prompts, lengths = workload(seed=7, count=20)
        want_out, want_lp = run_batch(model, tokenizer, prompts, lengths, None, max_batch=8)
        step = graphs.StepGraphs(8)
        out, lp = run_batch(model, tokenizer, prompts, lengths, step, max_batch=8)
        assert step.failed == "", step.failed
        assert out == want_out
        for a, b in zip(lp, want_lp, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        first = step.captures
        assert first >= len(step.graphs) >= 2, (first, sorted(step.graphs))
        # a sleep moves the weights to the host and back: new addresses, so capture again
        model.to("cpu")
        model.to("cuda")
        again, _ = run_batch(model, tokenizer, prompts, lengths, step, max_batch=8)
        assert again == want_out and step.captures > first
    finally:
        ref_model.to("cpu")
