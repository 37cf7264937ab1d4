"""The response text a reward reads (`with_response_text`): the tokenizer's own decode, also
where it is read straight from the Rust tokenizer (`response_decoder`)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from transformers import PreTrainedTokenizerFast

from rollouts.driver.setup import response_decoder, with_response_text
from rollouts.models.tiny import train_tokenizer
from rollouts.types import Sample, Status

CORPUS = [
    "the sum of 12 and 30 is 42.",
    "Hello , world ! It's  fine ?",
    "é ü ∑ 🙂 tabs\tand\nlines",
]


def random_ids(tokenizer: Any, seed: int, n: int) -> tuple[int, ...]:
    """Any ids of the vocabulary, special tokens included (skipped by the decode)."""
    rng = random.Random(seed)
    return tuple(rng.randrange(len(tokenizer)) for _ in range(n))


def test_the_same_text_as_the_tokenizers_decode(tokenizer: Any) -> None:
    bpe = train_tokenizer(CORPUS * 20, "bpe", vocab_size=300)
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer, clean_up_tokenization_spaces=True
    )
    for tok in (tokenizer, bpe, cleaning):
        decode = response_decoder(tok)
        for seed, n in [(0, 0), (1, 1), (2, 50), (3, 2000)]:
            ids = random_ids(tok, seed, n)
            assert decode(ids) == tok.decode(list(ids), skip_special_tokens=True)
        text = tok.decode(tok.encode(CORPUS[1]))
        assert decode(tuple(tok.encode(CORPUS[1]))) == text


class Letters:
    """A tokenizer that is no transformers one: its own decode is called."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert isinstance(ids, list), type(ids)
        return "".join(chr(ord("a") + i) for i in ids if not skip_special_tokens or i)


def test_another_tokenizer_keeps_its_own_decode() -> None:
    assert response_decoder(Letters())((0, 1, 2)) == "bc"


def test_the_reward_reads_the_text(tokenizer: Any) -> None:
    ids = tuple(tokenizer.encode("the sum is 42"))
    sample = Sample(
        index=0,
        group_index=0,
        prompt="q",
        tokens=(1, *ids),
        loss_mask=(0,) + (1,) * len(ids),
        response_length=len(ids),
        status=Status.COMPLETED,
    )
    reward = with_response_text(lambda s: s.metadata["response_text"], tokenizer)
    assert reward(sample) == tokenizer.decode(list(ids), skip_special_tokens=True)
    given = dataclasses.replace(sample, metadata={"response_text": "kept"})
    assert reward(given) == "kept"
