"""A LoRA adapter merged into its base model: a plain HF model directory that any engine serves
(a teacher or a judge of another run, `[teacher]`), written by `rollouts models merge`.

The merge is PEFT's own (`merge_and_unload`: W + scaling * B @ A per adapted layer) in the
base model's dtype; the tokenizer is the adapter directory's (the run saved it there)."""

from __future__ import annotations

import json
from pathlib import Path


def adapter_base(adapter: Path) -> str:
    """The base model an adapter directory names (`adapter_config.json`)."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{config}: not a LoRA adapter directory (a LoRA run's checkpoint has "
            "checkpoints/rl/step_N/adapter/)"
        )
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config} names no base_model_name_or_path: pass --base DIR")
    return str(base)


def merge_adapter(adapter: Path, out: Path, base: str | None = None) -> Path:
    """Write base + adapter to `out` (safetensors, config, tokenizer); returns `out`."""
    import peft
    import transformers

    base = base or adapter_base(adapter)
    if not Path(base).is_dir():
        raise FileNotFoundError(
            f"{adapter}: its base model {base} is not a directory here; pass --base DIR"
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer_dir = adapter if (adapter / "tokenizer_config.json").is_file() else Path(base)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
