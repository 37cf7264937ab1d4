"""LoRA RL against the real vLLM (CPU build, `--enable-lora`): SmolLM2-135M trains adapters, each
sync sends only the adapter (`/v1/load_lora_adapter`, requests name it in `model`), the engine's
logprobs with the adapter equal the trainer's after every sync, and sync mode stays on-policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_vllm.conftest import VLLMServer
from tests.real_vllm.test_vllm_training import FP32_MATCH, _config, _steps, _train

LORA = {
    "model__lora": {"enabled": True, "rank": 8, "alpha": 16.0},
    "algorithm__kl": {"coef": 0.05},
    "rollout": {"batch_size": 2, "n_samples_per_prompt": 4, "over_sampling_factor": 1.0},
}

pytestmark = pytest.mark.smollm2  # on the "smollm2" server (conftest.py)


def test_lora_rl_on_smollm2_syncs_the_adapter_alone(
    vllm: dict[str, VLLMServer], model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    model = model_dirs["smollm2"]
    config = _config(tmp_path, model, [vllm["smollm2"].url], "sync", evaluate=False, **LORA)
    steps = _steps(_train(config, start_line="serve the LoRA adapter of version 0"))
    full_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert row["sync/bytes"] < full_bytes / 20, (row["sync/bytes"], full_bytes)
        assert row["sync/content_gap_max"] < FP32_MATCH, row
        assert row["sync/failed_engines"] == 0.0, row
        assert row["train/logprob_mismatch"] < FP32_MATCH, row  # vLLM served the adapter
    assert steps[-1]["train/kl"] > 0  # the policy moved off its reference, the base model
