"""[run] and [model] (with [model.tiny] and [model.lora]) sections; [data] is in `data.py`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

TinyTokenizer = Literal["char", "bpe"]
# a packaged real model, built on first use (`rollouts.models.sources.SOURCES`); "" = none
ModelSourceName = Literal["", "smollm2-135m-instruct"]
ModelDtype = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["auto", "sdpa", "eager"]  # "auto": eager on CPU, sdpa on CUDA


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunSection(_Section):
    """[run]: naming, output and seeding of a run."""

    KEY: ClassVar[str] = "run"

    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 0
    overwrite: bool = False  # a fresh (not --resume) run may replace an earlier run's directory


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelConfig(_Section):
    """[model.tiny]: build a tiny model with the tiny-model kit when `model.path` is missing."""

    KEY: ClassVar[str] = "model.tiny"

    enabled: bool = False
    tokenizer: TinyTokenizer = "char"
    vocab_size: int = 512  # BPE only
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    tie_embeddings: bool = False  # the LM head shares the embedding matrix
    corpus_path: str = ""  # text the tokenizer is trained on ("" = the data files)
    # the random init; not run.seed, so one built model serves every run seed (reproducible)
    seed: int = 0

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _check(p, getattr(self, name) >= 1, f"model.tiny.{name}: must be >= 1")
        _check(
            p,
            self.hidden_size % max(self.num_heads, 1) == 0,
            f"model.tiny.hidden_size = {self.hidden_size}: must be divisible by num_heads",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig(_Section):
    """[model.lora]: train low-rank adapters (PEFT LoRA) instead of every weight.

    Only the adapters get gradients and optimizer state; the reference model is the base model
    (the adapters switched off: no second copy); engines get the adapter (weight_sync.lora).
    """

    KEY: ClassVar[str] = "model.lora"

    enabled: bool = False
    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input while training (0: logprobs stay exact)
    # "all-linear": every linear layer of the decoder (not the LM head); or module names
    target_modules: str | list[str] = "all-linear"
    # each checkpoint also holds the merged model (model/, a plain HF directory) beside the
    # adapter (adapter/): the full model's bytes per checkpoint
    save_merged: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.rank >= 1, f"model.lora.rank = {self.rank}: must be >= 1")
        _check(p, self.alpha > 0, f"model.lora.alpha = {self.alpha}: must be > 0")
        _check(
            p,
            0.0 <= self.dropout < 1.0,
            f"model.lora.dropout = {self.dropout}: must be in [0, 1)",
        )
        modules = self.target_modules
        _check(
            p,
            bool(modules) and (isinstance(modules, str) or all(modules)),
            f"model.lora.target_modules = {modules!r}: name modules, or 'all-linear'",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(_Section):
    """[model]: which model to train and how to hold it."""

    KEY: ClassVar[str] = "model"

    path: str = ""  # an HF directory or hub id; with `source`, where it is converted to
    source: ModelSourceName = ""  # a packaged real model (built on first use)
    tokenizer_path: str = ""  # "" = same as path
    dtype: ModelDtype = "float32"
    attn_implementation: AttnImplementation = "auto"
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer of the trained model (dynamic shapes; the first step
    # compiles: tens of seconds on CPU, cached on disk for the next run)
    compile: bool = False
    # parameters that keep their loaded values (no gradient, no optimizer state): each entry a
    # name's dotted part ("embed_tokens": the embeddings, and a head tied to them) or a glob over
    # the names ("*.layers.[0-3].*"); the trainer prints what each froze
    freeze: list[str] = dataclasses.field(default_factory=list)
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            not (self.source and self.tiny.enabled),
            "model.source and model.tiny.enabled are both set: keep one of them",
        )
        _check(
            p,
            not (self.freeze and self.lora.enabled),
            f"model.freeze = {self.freeze!r} with model.lora.enabled: LoRA already trains only "
            "its adapters; remove model.freeze",
        )
        _check(p, all(self.freeze), "model.freeze: an empty name; name parameters or remove it")
        return p
