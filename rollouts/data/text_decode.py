"""Response ids to text for rewards: `tokenizer.decode(ids, skip_special_tokens=True)`, faster.

The driver decodes every response once for its reward (`metadata["response_text"]`). A
transformers fast tokenizer spends a third of a 1k-token decode in `to_py_obj`'s per-token type
checks and the rest in the Rust tokenizer's strings per token. A byte-level BPE tokenizer (GPT-2,
Llama 3, Qwen, SmolLM) decodes to the UTF-8 text of its tokens' bytes joined, so a table of each
id's bytes and one `bytes.decode` give the same text 5x faster. The table is built and then
checked against the tokenizer's own decode of its whole vocabulary; any tokenizer it does not
fit decodes as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

Decode = Callable[[Sequence[int]], str]
CHECK_CHUNK = 256  # ids a decode of the self-check joins (the whole vocabulary, shuffled)


def byte_level_chars() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte (`bytes_to_unicode`), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars |= {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


def token_bytes(token: str, chars: dict[str, int]) -> bytes:
    """One token's bytes as the ByteLevel decoder gives them: each character's byte, or the
    token's own UTF-8 when a character has none (an added token's plain text)."""
    try:
        return bytes(chars[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def byte_table(tokenizer: Any) -> tuple[bytes | None, ...] | None:
    """Each id's bytes (b"" for a special token, which the decode skips; None for an id with
    no token) when `tokenizer` decodes as byte-level BPE does, else None."""
    if not same_decode(tokenizer):
        return None
    backend = tokenizer.backend_tokenizer
    if type(backend.decoder) is not decoders.ByteLevel:
        return None
    chars = byte_level_chars()
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    vocab = backend.get_vocab(with_added_tokens=True)
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = b"" if token in special else token_bytes(token, chars)
    return tuple(table)


def same_decode(tokenizer: Any) -> bool:
    """A transformers fast tokenizer whose decode is its library's, with no space clean-up:
    its text is its Rust tokenizer's decode."""
    kind = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )


def decodes_alike(table: tuple[bytes | None, ...], rust: Decode, seed: int = 0) -> bool:
    """The table's text equals the tokenizer's for every id of the vocabulary, in shuffled
    chunks (bytes of neighbouring tokens that make no UTF-8 character included)."""
    ids = [i for i, piece in enumerate(table) if piece is not None]
    random.Random(seed).shuffle(ids)
    for start in range(0, len(ids), CHECK_CHUNK):
        chunk = ids[start : start + CHECK_CHUNK]
        text = b"".join(map(table.__getitem__, chunk)).decode("utf-8", "replace")  # type: ignore[arg-type]
        if text != rust(chunk):
            return False
    return True


def response_decoder(tokenizer: Any) -> Decode:
    """`tokenizer.decode(list(ids), skip_special_tokens=True)` as a function of the ids: by the
    table of a byte-level BPE tokenizer that passed the self-check, else by the Rust tokenizer
    for a fast tokenizer with its library's decode, else by `tokenizer.decode` itself."""
    if not same_decode(tokenizer):
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    backend = tokenizer.backend_tokenizer

    def rust(ids: Sequence[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    table = byte_table(tokenizer)
    if table is None or not decodes_alike(table, rust):
        return rust
    piece = table.__getitem__

    def by_table(ids: Sequence[int]) -> str:
        try:
            if ids and min(ids) < 0:
                raise IndexError("a negative id")  # the table would count it from its end
            joined = b"".join(map(piece, ids))  # type: ignore[arg-type]
        except (IndexError, TypeError):  # no token for an id, or no int: the tokenizer's answer
            return rust(ids)
        return joined.decode("utf-8", "replace")

    return by_table
