"""The engine's shared-prefix prefill (`kv.prefill` with a `SharedPrefix`): prompts that start
alike (an agent's system message, a group's question) have their common prefix prefilled once and
kept for the next admission. Their tokens and logprobs are those of whole prompts, while rows
join and leave, on every decode path and model family; a prefix kept from weights no longer
loaded is never used."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollouts.engine import kv
from rollouts.engine.batch import RunningBatch
from tests.engine.batch_driver import greedy_through_batch, serve_on
from tests.gqa_models import llama_gqa, qwen2
from tests.hf_reference import teacher_forced_logprobs


def alike_prompts(seed: int, count: int) -> tuple[list[list[int]], list[int]]:
    """`count` prompts: a system message of 40-50 tokens, one of three questions, then 0-30
    tokens of their own (so some are equal, some a prefix of others; the padding between the
    prefix and the rest is over kv.ALIGN_COLS columns), and one short
    prompt unlike them; 4-16 new tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(rng.randint(40, 50))]
    questions = [system + [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))] for _ in "abc"]
    prompts = [
        questions[i % 3] + [rng.randrange(3, 250) for _ in range(rng.randint(0, 30))]
        for i in range(count - 1)
    ]
    prompts.insert(count // 2, [rng.randrange(3, 250) for _ in range(5)])
    return prompts, [rng.randint(4, 16) for _ in prompts]


@pytest.fixture(scope="module")
def models(ref_model, tokenizer) -> dict[str, torch.nn.Module]:
    vocab = len(tokenizer)
    return {"llama": ref_model, "llama-gqa-tied": llama_gqa(vocab), "qwen2": qwen2(vocab)}


@pytest.mark.parametrize(
    ("name", "decode"),
    [("llama", "auto"), ("llama", "hf"), ("llama-gqa-tied", "auto"), ("qwen2", "auto")],
)
def test_shared_prefixes_give_the_whole_prompts_tokens_and_logprobs(
    models, tokenizer, name, decode
):
    model = models[name]
    prompts, lengths = alike_prompts(seed=len(name), count=13)
    batches: list[RunningBatch] = []
    runs = {
        share: greedy_through_batch(
            model,
            tokenizer,
            prompts,
            lengths,
            max_batch=4,
            decode=decode,
            admit_rng=random.Random(7),  # rows join a few at a time while others decode
            share_prefix=share,
            batches=batches,
        )
        for share in (True, False)
    }
    shared_out, shared_lp, _ = runs[True]
    whole_out, whole_lp, _ = runs[False]
    assert batches[0].shared_tokens > 30 * len(prompts), "the prefix was not shared"
    assert batches[1].shared_tokens == 0
    assert shared_out == whole_out
    for prompt, out, lp, ref in zip(prompts, shared_out, shared_lp, whole_lp, strict=True):
        assert len(out) == len(lp) == len(ref)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)
        forced = teacher_forced_logprobs(model, prompt, out)
        torch.testing.assert_close(torch.tensor(lp), forced, atol=1e-4, rtol=0)
    assert len({tuple(o) for o in shared_out}) > 3, "the prompts gave the same outputs"


def test_a_prefix_kept_from_other_weights_is_never_used(
    ref_model, tokenizer, other_model_dir: Path
):
    # the kept prefix's keys and values are the weights' of when it was prefilled: after a reload
    # (in place, as the server's) the same prompts must be prefilled on the new weights
    model = copy.deepcopy(ref_model)
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    prompts, lengths = alike_prompts(seed=3, count=7)
    del prompts[3], lengths[3]  # the short one unlike the others: all six share a prefix
    batches: list[RunningBatch] = []
    before, _, _ = greedy_through_batch(
        model, tokenizer, prompts, lengths, max_batch=8, batches=batches
    )
    batch = batches[0]
    assert batch._shared is not None and batch._shared.tokens, "nothing kept to go stale"
    with torch.no_grad():
        for name, tensor in other.state_dict().items():
            model.state_dict()[name].copy_(tensor)
    batch.weights_changed()
    assert not batch._shared.tokens
    # the same batch object serves the same prompts again, on the new weights
    after, after_lp = serve_on(batch, prompts, lengths)
    want, want_lp, _ = greedy_through_batch(
        other, tokenizer, prompts, lengths, max_batch=8, share_prefix=False
    )
    assert after == want and after != before
    for lp, ref in zip(after_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)


def test_prompts_with_a_short_common_prefix_are_prefilled_whole(tiny_model_dir):
    prompts = [[5, 6, 7] + [9] * 20, [5, 6, 7] + [8] * 20]
    assert kv.common_prefix_len(prompts) == 3 < kv.MIN_SHARED
    shared = kv.SharedPrefix()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    _, mask, _ = kv.prefill(model, prompts, 0, shared)
    assert shared.saved == 0 and not shared.tokens and mask.shape == (2, 23)


def test_a_row_left_alone_still_reads_its_prefix_across_the_padding(ref_model, tokenizer):
    # prompt 0 has a long rest and leaves at once (1 new token); prompt 1's short rest is padded
    # after the shared prefix, so the columns it reads start where its prefix does, not where
    # its padding ends
    rng = random.Random(11)
    system = [rng.randrange(3, 250) for _ in range(45)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(35)], [*system, 17]]
    lengths = [1, 16]
    runs = {
        share: greedy_through_batch(
            ref_model, tokenizer, prompts, lengths, max_batch=2, share_prefix=share
        )
        for share in (True, False)
    }
    assert runs[True][0] == runs[False][0]
    for lp, ref in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)
