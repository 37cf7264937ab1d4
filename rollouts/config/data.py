"""[data]: the prompt and conversation datasets, their columns, and mixtures ([[data.sources]])."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import ClassVar

from rollouts.config.base import _check, _Section

SOURCE_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # it names metrics: source/<name>/reward


def chat_problems(key: str, user_template: str, system_prompt: str) -> list[str]:
    """A user template must say where the prompt goes; a system prompt needs a template."""
    p: list[str] = []
    _check(
        p,
        not user_template or "{prompt}" in user_template,
        f"{key}.user_template = {user_template!r}: must hold {{prompt}}, where the dataset's "
        "text goes",
    )
    _check(
        p,
        not system_prompt or bool(user_template),
        f"{key}.system_prompt is set but {key}.user_template is empty: text prompts are sent as "
        'text; set user_template = "{prompt}" to send them as chat messages',
    )
    return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig(_Section):
    """One [[data.sources]] entry of a mixture: a dataset (any kind `data.sources` reads), its
    weight in the interleave, its held-out set, and its columns ("" = the [data] key's)."""

    KEY: ClassVar[str] = "data.sources[]"

    name: str = ""
    path: str = ""
    weight: float = 1.0  # its share of the prompts drawn: weight / the sum of the weights
    eval_path: str = ""  # held-out prompts, evaluated and reported apart (eval/<name>/accuracy)
    split: str = "train"  # of a `datasets` directory or hub dataset holding several
    eval_split: str = "test"
    subset: str = ""  # a hub dataset's config name ("main" of openai/gsm8k)
    prompt_key: str = ""
    label_key: str | None = None  # None = data.label_key; "" = no labels
    messages_key: str = ""
    metadata_keys: list[str] = dataclasses.field(default_factory=list)
    user_template: str | None = None  # None = data.user_template
    system_prompt: str | None = None  # None = data.system_prompt

    def problems(self) -> list[str]:
        p: list[str] = []
        k = self.KEY
        p += chat_problems(k, self.user_template or "", self.system_prompt or "")
        _check(
            p,
            math.isfinite(self.weight) and self.weight > 0,
            f"{k}.weight = {self.weight}: must be > 0 (a source that should not be drawn from "
            "is left out of data.sources)",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig(_Section):
    """[data]: prompt and conversation datasets: JSONL, JSON, parquet, a `datasets` directory
    (save_to_disk) or a hub name; one `train_path`, or a mixture of `sources`."""

    KEY: ClassVar[str] = "data"

    train_path: str = ""
    eval_path: str = ""
    sft_path: str = ""
    sft_eval_fraction: float = 0.05
    prompt_key: str = "prompt"  # a dotted key reaches into a nested column
    label_key: str = "label"  # "" = no labels
    messages_key: str = "messages"
    metadata_keys: list[str] = dataclasses.field(default_factory=list)  # [] = every other column
    train_split: str = "train"  # of a `datasets` directory or hub dataset holding several
    eval_split: str = "test"
    subset: str = ""  # a hub dataset's config name
    # a text prompt sent as a user message through the chat template: this text with {prompt}
    # replaced by it ("" = sent as text, no template); GSM8K's questions need it
    user_template: str = ""
    system_prompt: str = ""  # a system message before that user message ("" = none)
    sources: list[SourceConfig] = dataclasses.field(default_factory=list)  # a mixture
    shuffle: bool = True
    eval_size: int = 0  # held-out prompts evaluated (of a mixture: per source); 0 = all
    max_length: int = 0  # tokens of the longest SFT conversation; 0 = the model's context
    prepare: str = ""  # dotted path to `fn(data_config) -> None` writing missing data files

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            0.0 <= self.sft_eval_fraction < 1.0,
            f"data.sft_eval_fraction = {self.sft_eval_fraction}: must be in [0, 1)",
        )
        _check(p, self.eval_size >= 0, f"data.eval_size = {self.eval_size}: must be >= 0")
        _check(
            p,
            self.max_length >= 0,
            f"data.max_length = {self.max_length}: must be >= 0 (0 = the model's context)",
        )
        _check(
            p,
            bool(self.prompt_key or self.messages_key),
            "data.prompt_key and data.messages_key are both empty: name the prompt's column",
        )
        p += chat_problems(self.KEY, self.user_template, self.system_prompt)
        return p + self._mixture_problems()

    def _mixture_problems(self) -> list[str]:
        if not self.sources:
            return []
        p: list[str] = []
        for key in ("train_path", "eval_path"):
            _check(
                p,
                not getattr(self, key),
                f"data.{key} = {getattr(self, key)!r} with [[data.sources]]: a mixture's "
                f"datasets are its sources (`path`, `eval_path`); remove data.{key}",
            )
        for i, source in enumerate(self.sources):
            _check(
                p,
                bool(SOURCE_NAME.match(source.name)),
                f"data.sources[{i}].name = {source.name!r}: every source needs a name of "
                "letters, digits, '_', '.' or '-' (it names the source's metrics)",
            )
            _check(
                p,
                bool(source.path),
                f"data.sources[{i}].path is empty: point it at the source's dataset",
            )
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        _check(p, not dup, f"data.sources: the names {dup} are used twice; names must differ")
        return p
