"""Sampling seeds (issue 27, item 7): derived from the run seed, the batch and the sample, sent
with every request, honoured by the real built-in server, and what makes two managers with the
same seed make the same batch (in group order, whatever order the groups finished in)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from rollouts.engine.launch import EngineProcess
from rollouts.engine.sampling import (
    CDF_BLOCK,
    GOLDEN,
    MIX_1,
    MIX_2,
    BatchSampling,
    inverse_cdf,
    sample,
    seed_as_int64,
    seeded_uniforms,
)
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import sampling_body
from rollouts.inference.vllm import completion_body
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.seeds import request_seed
from rollouts.wire.generation import SamplingParams
from tests.rollout import manager_cases as cases


def test_seeds_name_the_run_the_batch_and_the_sample() -> None:
    base = request_seed(0, 1, 2, 3, 0)
    assert base == request_seed(0, 1, 2, 3, 0)  # pure: a resumed run sends the same
    others = {
        request_seed(1, 1, 2, 3, 0),  # run seed
        request_seed(0, 2, 2, 3, 0),  # batch
        request_seed(0, 1, 3, 3, 0),  # group
        request_seed(0, 1, 2, 4, 0),  # place in the group
        request_seed(0, 1, 2, 3, 5),  # a partial rollout resumed after 5 tokens
    }
    assert base not in others and len(others) == 5
    assert all(0 <= s < 2**63 for s in others | {base})  # what every engine takes (int64)


def test_every_engine_kind_gets_the_seed() -> None:
    sampling = SamplingParams(max_new_tokens=4, seed=123)
    assert sampling_body(sampling)["sampling_seed"] == 123  # SGLang and the built-in server
    assert completion_body([1, 2], sampling, None, "m")["seed"] == 123  # vLLM


@pytest.fixture(params=["batched", "per-sample"])
async def engine(server: EngineProcess, request) -> AsyncIterator[SGLangEngine]:
    client = SGLangEngine(server.url)
    client.batch_generate = request.param == "batched"
    try:
        yield client
    finally:
        await client.aclose()


async def _batch(engine: SGLangEngine, tok, seed: int | None, number: int = 4) -> list:
    config = cases.make_config(
        batch_size=3, n_samples_per_prompt=4, over_sampling_factor=1.0, max_new_tokens=12
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok, seed=seed)
    batch = await manager.generate_batch(lambda s: 0.0, batch_number=number)
    return [(s.group_index, s.tokens, s.rollout_logprobs) for s in batch.samples]


async def test_the_same_seed_makes_the_same_batch_on_the_real_server(engine, tok) -> None:
    first = await _batch(engine, tok, seed=7)
    again = await _batch(engine, tok, seed=7)
    assert [g for g, *_ in first] == sorted(g for g, *_ in first)  # in group order
    assert [t for _, t, _ in first] == [t for _, t, _ in again]  # the same tokens
    for (_, _, lp1), (_, _, lp2) in zip(first, again, strict=True):  # batch floats only
        assert lp1 == pytest.approx(lp2, abs=1e-5)
    other_seed = await _batch(engine, tok, seed=8)
    other_batch = await _batch(engine, tok, seed=7, number=5)
    assert [t for _, t, _ in other_seed] != [t for _, t, _ in first]
    assert [t for _, t, _ in other_batch] != [t for _, t, _ in first]


async def test_the_samples_of_a_group_get_seeds_of_their_own(engine, tok) -> None:
    """One prompt, four samples, one seed per sample: four different continuations."""
    tokens = [t for _, t, _ in await _batch(engine, tok, seed=7)][:4]
    assert len(set(tokens)) == 4, tokens


def sampling_of(seeds: list[int | None], draws: list[int] | None = None) -> BatchSampling:
    """A row per seed (None: the global RNG) at temperature 1, no top-k/top-p/min-p, each at
    its `draws`-th token (default: its first)."""
    rows = len(seeds)
    seeded = [seed is not None for seed in seeds]
    return BatchSampling(
        temp_B=torch.ones(rows),
        top_k_B=torch.full((rows,), -1),
        top_p_B=torch.ones(rows),
        min_p_B=torch.zeros(rows),
        greedy_B=torch.zeros(rows, dtype=torch.bool),
        filtered=False,
        greedy=False,
        sampled=True,
        seed_B=torch.tensor([seed_as_int64(seed or 0) for seed in seeds]),
        draw_B=torch.tensor(draws or [0] * rows),
        seeded_B=torch.tensor(seeded),
        seeded=any(seeded),
        unseeded=not all(seeded),
    )


def splitmix64(seed: int, draw: int) -> int:
    """The `draw`-th output (from 0) of splitmix64 seeded with `seed`, in Python's integers."""
    mask = 2**64 - 1
    z = (seed + (draw + 1) * GOLDEN) & mask
    z = ((z ^ (z >> 30)) * MIX_1) & mask
    z = ((z ^ (z >> 27)) * MIX_2) & mask
    return z ^ (z >> 31)


def test_seeded_uniforms_are_splitmix64s_outputs_bit_for_bit() -> None:
    """The int64 tensor arithmetic (wrapping products, logical shifts) gives the generator's
    uint64 outputs for seeds across the whole range SGLang's and torch's seeds take."""
    g = torch.Generator().manual_seed(0)
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), 123456789]
    seeds += torch.randint(-(2**63), 2**63 - 1, (200,), generator=g).tolist()
    draws = [0, 1, 2, 1000, 2**40, *torch.randint(0, 10**6, (203,), generator=g).tolist()]
    u = seeded_uniforms(
        torch.tensor([seed_as_int64(s) for s in seeds]), torch.tensor(draws[: len(seeds)])
    )
    expected = [(splitmix64(s, d) >> 11) * 2.0**-53 for s, d in zip(seeds, draws, strict=False)]
    assert u.dtype == torch.float64 and u.tolist() == expected
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF  # splitmix64's first output from seed 0


def test_the_built_in_engines_seeded_draws_follow_the_probabilities() -> None:
    """Its seeded rows sample by inverse CDF from one uniform of their seed and draw count."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().repeat(20000, 1)
    tokens, _ = sample(logits, sampling_of(list(range(len(logits)))), "raw")
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert torch.allclose(freq, probs.double(), atol=0.015), freq
    assert int((tokens == 1).sum()) == 0  # a token without mass never comes
    # one seed's successive draws follow them too
    later, _ = sample(logits, sampling_of([5] * len(logits), list(range(len(logits)))), "raw")
    freq = torch.bincount(later, minlength=4).double() / len(later)
    assert torch.allclose(freq, probs.double(), atol=0.015), freq
    torch.manual_seed(123)  # the global RNG moved: seeded rows do not see it
    mixed = [0, None, 2, None, 4]  # beside unseeded rows
    again, _ = sample(logits[:5], sampling_of(mixed), "raw")
    assert again[::2].tolist() == tokens[:5:2].tolist()  # a row's draw: its probabilities and seed


def test_the_two_level_inverse_cdf_draws_what_one_float64_cumsum_draws() -> None:
    """`inverse_cdf` against the plain draw (one float64 cumsum over the whole vocabulary):
    the same token for the same uniform, on a vocabulary that is not a multiple of the block,
    with tokens filtered out (no mass), and at the ends of the unit interval."""
    g = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_BLOCK + 77
    logits = torch.randn(64, vocab, generator=g) * 4
    logits[:, ::3] = float("-inf")  # a third of the vocabulary filtered
    logits[:, -100:] = float("-inf")  # and the tail, across the last block boundary
    probs = logits.softmax(dim=1)
    for u in (torch.rand(64, generator=g, dtype=torch.float64), torch.zeros(64)):
        cdf = probs.double().cumsum(dim=1)
        plain = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        assert inverse_cdf(probs, u).tolist() == plain.tolist()
    top = inverse_cdf(probs, torch.full((64,), 1.0 - 2.0**-53, dtype=torch.float64))
    assert bool((probs.gather(1, top.unsqueeze(1)) > 0).all())  # never a token without mass
    assert all(t < vocab - 100 for t in top.tolist())  # not into the filtered tail


def test_unseeded_rows_draw_from_the_global_rng_by_the_same_inverse_cdf() -> None:
    """The batch's unseeded rows (no `multinomial`): the frequencies follow the probabilities
    and one `torch.manual_seed` repeats them."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().repeat(20000, 1)
    rows = len(logits)
    batch = sampling_of([None] * rows)
    torch.manual_seed(3)
    tokens, logprobs = sample(logits, batch, "raw")
    freq = torch.bincount(tokens, minlength=4).double() / rows
    assert torch.allclose(freq, probs.double(), atol=0.015), freq
    assert int((tokens == 1).sum()) == 0
    assert torch.allclose(logprobs, probs.log()[tokens])
    torch.manual_seed(3)
    assert sample(logits, batch, "raw")[0].tolist() == tokens.tolist()
