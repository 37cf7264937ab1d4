"""[model.lora] and weight_sync.lora: defaults, range checks, and what LoRA needs of the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import ConfigError, LoraConfig, config_from_dict, load_config


def test_lora_is_off_by_default_and_targets_every_linear_layer() -> None:
    config = config_from_dict({})
    assert config.model.lora == LoraConfig()
    assert not config.model.lora.enabled
    assert config.model.lora.target_modules == "all-linear"
    assert config.weight_sync.lora == "adapter"


def test_a_lora_table_is_read_with_module_names(tmp_path: Path) -> None:
    path = tmp_path / "lora.toml"
    path.write_text(
        "[model.lora]\nenabled = true\nrank = 8\nalpha = 16\ndropout = 0.05\n"
        'target_modules = ["q_proj", "v_proj"]\n[weight_sync]\nlora = "merged"\n'
    )
    config = load_config(path)
    lora = config.model.lora
    assert (lora.enabled, lora.rank, lora.alpha, lora.dropout) == (True, 8, 16.0, 0.05)
    assert lora.target_modules == ["q_proj", "v_proj"]
    assert config.weight_sync.lora == "merged"


def test_lora_values_out_of_range_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "model": {"lora": {"rank": 0, "alpha": -1, "dropout": 1.0, "target_modules": []}},
                "weight_sync": {"lora": "adaptr"},
            }
        )
    text = str(info.value)
    assert "model.lora.rank = 0: must be >= 1" in text
    assert "model.lora.alpha = -1.0: must be > 0" in text
    assert "model.lora.dropout = 1.0: must be in [0, 1)" in text
    assert "model.lora.target_modules = []" in text
    assert "weight_sync.lora = 'adaptr': must be one of ['adapter', 'merged']" in text


def test_lora_refuses_what_it_cannot_do_yet_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "model": {"lora": {"enabled": True}},
                "algorithm": {"reference": {"update": "ema"}},
                "weight_sync": {"method": "distributed"},
            }
        )
    text = str(info.value)
    assert "the reference is the base model" in text
    assert "set algorithm.reference.update = 'none'" in text
    assert "set weight_sync.method = 'disk', or weight_sync.lora = 'merged'" in text


def test_merged_lora_sync_may_broadcast_and_lora_off_checks_nothing() -> None:
    merged = {"model": {"lora": {"enabled": True}}, "weight_sync": {"lora": "merged"}}
    config_from_dict(merged | {"training": {"backend": "fsdp", "nproc": 2}})  # LoRA under FSDP2
    config_from_dict(merged | {"weight_sync": {"lora": "merged", "method": "distributed"}})
    config_from_dict({"training": {"backend": "fsdp"}, "weight_sync": {"method": "distributed"}})
