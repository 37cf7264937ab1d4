"""The response text a reward reads (`with_response_text`): the tokenizer's own decode, also
where it is read from a byte-level tokenizer's table of bytes or straight from the Rust
tokenizer (`text_decode.response_decoder`)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from transformers import PreTrainedTokenizerFast

from rollouts.data.text_decode import byte_table, response_decoder
from rollouts.driver.setup import with_response_text
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


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (no byte-level decoder: no table)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"])
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def tokenizers_to_check(tokenizer: Any) -> list[tuple[Any, bool]]:
    """(tokenizer, whether its decode goes by the byte table)."""
    bpe = train_tokenizer(CORPUS * 20, "bpe", vocab_size=300)
    added = train_tokenizer(CORPUS * 20, "bpe", vocab_size=300)
    added.add_tokens(["héllo wörld", "<tool>", " 42"])  # plain text, not byte-level characters
    added.add_special_tokens({"additional_special_tokens": ["<|secret|>"]})
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer, clean_up_tokenization_spaces=True
    )
    metaspace = metaspace_tokenizer()
    return [(tokenizer, True), (bpe, True), (added, True), (cleaning, False), (metaspace, False)]


def test_the_same_text_as_the_tokenizers_decode(tokenizer: Any) -> None:
    for tok, by_table in tokenizers_to_check(tokenizer):
        assert (byte_table(tok) is not None) == by_table, tok
        decode = response_decoder(tok)
        table = byte_table(tok) or ()
        partial = [i for i, piece in enumerate(table) if piece and max(piece) >= 0x80]
        rng = random.Random(0)
        for n in [0, 1, 2, 50, 2000]:
            ids = random_ids(tok, n, n)
            assert decode(ids) == tok.decode(list(ids), skip_special_tokens=True)
            if partial:  # bytes that make no UTF-8 character alone: replaced alike
                ids = tuple(rng.choice(partial) for _ in range(n))
                assert decode(ids) == tok.decode(list(ids), skip_special_tokens=True)
        for text in [*CORPUS, "héllo wörld<tool> 42<|secret|>"]:
            ids = tuple(tok.encode(text))
            assert decode(ids) == tok.decode(list(ids), skip_special_tokens=True)


def test_ids_with_no_token_give_what_the_tokenizer_gives(tokenizer: Any) -> None:
    decode = response_decoder(tokenizer)
    for ids in [(-1, 5), (5, len(tokenizer)), (5, 10**12), (5.0, 6), (True, 6), (5, None)]:
        want = outcome(tokenizer.decode, list(ids), skip_special_tokens=True)
        assert outcome(decode, ids) == want, ids


def outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("text", what `fn` gives) or ("raised", its error's type)."""
    try:
        return "text", fn(*args, **kwargs)
    except Exception as e:
        return "raised", type(e)


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


def test_smollm2_decodes_by_its_table_alike(smollm2_dir: Any) -> None:
    from transformers import AutoTokenizer

    from rollouts.data.text_decode import decodes_alike

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    table = byte_table(tok)
    assert table is not None
    decode = response_decoder(tok)
    partial = [i for i, piece in enumerate(table) if piece and max(piece) >= 0x80]
    rng = random.Random(0)
    for n in range(0, 3000, 97):
        pool = partial if n % 2 else range(len(tok))
        ids = tuple(rng.choice(pool) for _ in range(n))
        assert decode(ids) == tok.decode(list(ids), skip_special_tokens=True)
    wrong = list(table)
    wrong[partial[0]] = b"?"  # one token's bytes wrong: the self-check refuses the table

    def rust(ids: Any) -> str:
        return tok.backend_tokenizer.decode(ids, skip_special_tokens=True)

    assert decodes_alike(table, rust)
    assert not decodes_alike(tuple(wrong), rust)
