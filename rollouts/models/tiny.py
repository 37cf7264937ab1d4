"""The tiny-model kit: a locally trained tokenizer with a chat template and a small Llama model.

Nothing is downloaded. The tokenizer is byte-level: with `kind="char"` it has no merges (every
byte is one token, so encoding is append-only: encode(a + b) == encode(a) + encode(b)), with
`kind="bpe"` it learns merges from a corpus (digits are always split one per token). The model is
a `LlamaConfig` causal LM saved with `save_pretrained`, so everything loads back with
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` like any real model.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollouts.config import TinyTokenizer

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOKENIZERS = typing.get_args(TinyTokenizer)

# ChatML. Append-only: rendering messages[:k] is a prefix of rendering messages[:k+1], which the
# multi-turn agent loop relies on (and checks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelSpec:
    """Sizes of a tiny model and its tokenizer."""

    tokenizer: TinyTokenizer = "char"
    vocab_size: int = 512  # BPE target vocabulary (char: 256 bytes + specials)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    tie_embeddings: bool = False  # the LM head shares the embedding (as SmolLM2, Qwen2-0.5B)
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.tokenizer in TOKENIZERS, f"{self.tokenizer=} not in {TOKENIZERS}"
        assert self.hidden_size % self.num_heads == 0, (
            f"{self.hidden_size=} not divisible by {self.num_heads=}"
        )


def train_tokenizer(
    corpus: Iterable[str], kind: TinyTokenizer = "char", vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ChatML special tokens and chat template, trained locally."""
    assert kind in TOKENIZERS, f"{kind=} not in {TOKENIZERS}"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    target = len(alphabet) + len(SPECIAL_TOKENS) if kind == "char" else vocab_size
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) or [""], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )
    return fast


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised small Llama causal LM sized for `tokenizer` (fp32, seeded)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def make_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, corpus: Iterable[str] = ()
) -> Path:
    """Train a tokenizer, build a tiny model, and save both to `out_dir` (HF format), with the
    spec it was built from in `SPEC_FILE` (so a later run can tell whether it still matches)."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, spec.tokenizer, spec.vocab_size)
    model = build_tiny_model(spec, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=1) + "\n")
    assert (out / "config.json").is_file(), f"no config.json written in {out}"
    return out


SPEC_FILE = "tiny_model_spec.json"


def spec_differences(model_dir: str | Path, spec: TinyModelSpec) -> dict[str, tuple[Any, Any]]:
    """{field: (built, asked)} where the tiny model in `model_dir` was built from another spec
    (empty when it matches, or when the directory has no spec file: not built by the kit)."""
    path = Path(model_dir) / SPEC_FILE
    if not path.is_file():
        return {}
    built = json.loads(path.read_text())
    asked = dataclasses.asdict(spec)
    default = dataclasses.asdict(TinyModelSpec())  # a field newer than the file: its default
    return {
        k: (built.get(k, default[k]), v) for k, v in asked.items() if built.get(k, default[k]) != v
    }
