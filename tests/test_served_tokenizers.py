"""A teacher's tokenizer must be the student's: `tokenizer_mismatch` names the first token id
that differs (inside the shared range, past its end, or a special token's id)."""

from __future__ import annotations

from rollouts.driver.served import tokenizer_mismatch


class Vocab:
    """A tokenizer's id -> token table and its special ids (what the check reads)."""

    def __init__(self, tokens: list[str], eos: int = 0) -> None:
        self.tokens, self.eos_token_id = tokens, eos
        self.bos_token_id = self.pad_token_id = None

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokens[i] for i in ids]


def test_the_same_tokenizer_passes(tokenizer) -> None:
    assert tokenizer_mismatch(tokenizer, tokenizer) is None


def test_the_first_differing_id_is_named() -> None:
    found = tokenizer_mismatch(Vocab(["<s>", "a", "b", "c"]), Vocab(["<s>", "a", "x", "c"]))
    assert found == "token id 2 is 'b' for the student and 'x' for the teacher"


def test_a_longer_vocabulary_is_named_at_its_first_extra_id() -> None:
    found = tokenizer_mismatch(Vocab(["<s>", "a"]), Vocab(["<s>", "a", "ab"]))
    assert found is not None and found.startswith("token id 2 is 'ab' for the teacher and none")


def test_a_special_token_of_another_id_is_named() -> None:
    found = tokenizer_mismatch(Vocab(["<s>", "a"], eos=0), Vocab(["<s>", "a"], eos=1))
    assert found == "eos_token_id is 0 for the student and 1 for the teacher"
