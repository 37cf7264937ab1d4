from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import (
    Config,
    ConfigError,
    RolloutConfig,
    apply_overrides,
    config_from_dict,
    load_config,
)


def test_defaults_are_valid() -> None:
    config = Config()
    assert config.rollout.over_sampling_factor == 1.5
    assert config.algorithm.clip_ratio_c == 3.0


def test_load_toml_with_nested_tables(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[run]\nseed = 3\n[rollout]\nbatch_size = 2\n[rollout.sampling]\ntemperature = 0\n"
        "[model.tiny]\nenabled = true\nhidden_size = 32\n"
    )
    config = load_config(path)
    assert config.run.seed == 3
    assert config.rollout.batch_size == 2
    assert config.rollout.sampling.temperature == 0.0  # int widened to float
    assert isinstance(config.rollout.sampling.temperature, float)
    assert config.model.tiny.hidden_size == 32


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rollout": {"over_sampling_factr": 2.0}})
    message = str(info.value)
    assert "rollout.over_sampling_factr: unknown key" in message
    assert "did you mean 'rollout.over_sampling_factor'" in message


def test_unknown_section() -> None:
    with pytest.raises(ConfigError, match="rollot: unknown key.*did you mean 'rollout'"):
        config_from_dict({"rollot": {}})


def test_bad_type_names_key_and_type() -> None:
    with pytest.raises(ConfigError, match=r"rollout.batch_size = 'eight': must be int, got str"):
        config_from_dict({"rollout": {"batch_size": "eight"}})


def test_bool_is_not_an_int() -> None:
    with pytest.raises(ConfigError, match="rollout.batch_size = True: must be int"):
        config_from_dict({"rollout": {"batch_size": True}})


def test_out_of_range_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"rollout.over_sampling_factor = 0.5: must be >= 1.0"):
        config_from_dict({"rollout": {"over_sampling_factor": 0.5}})


def test_several_problems_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        "[rollout]\nover_sampling_factor = 0.5\nbatch_sise = 4\n"
        '[algorithm]\nclip_ratio_c = 0.9\nloss_agg = "mean"\n[optim]\nlr = "high"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert len(problems) == 5, problems
    text = str(info.value)
    assert str(path) in text
    assert "rollout.batch_sise: unknown key" in text
    assert "algorithm.clip_ratio_c = 0.9: must be > 1.0" in text
    assert "algorithm.loss_agg = 'mean': must be one of" in text
    assert "optim.lr = 'high': must be float" in text


def test_list_item_types_checked() -> None:
    with pytest.raises(ConfigError, match=r"rollout.sampling.stop_token_ids\[1\] = 'x'"):
        config_from_dict({"rollout": {"sampling": {"stop_token_ids": [1, "x"]}}})


def test_section_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match=r"rollout: must be a table"):
        config_from_dict({"rollout": 3})


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load_config(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("/nonexistent/x.toml")


def test_overrides_parse_toml_values(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\nbatch_size = 2\n")
    config = load_config(
        path, ["rollout.batch_size=5", "run.name=demo", "rollout.sampling.stop=['a','b']"]
    )
    assert config.rollout.batch_size == 5
    assert config.run.name == "demo"
    assert config.rollout.sampling.stop == ["a", "b"]
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["nonsense"])


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt = 0"):
        RolloutConfig(n_samples_per_prompt=0)


def test_engines_need_urls_for_external_servers() -> None:
    with pytest.raises(ConfigError, match="engines.urls: must list the server URLs"):
        config_from_dict({"engines": {"kind": "sglang"}})


def test_a_moved_key_works_at_its_old_place_and_names_the_new_one(monkeypatch, capsys) -> None:
    from rollouts.config import loader

    monkeypatch.setitem(loader.MOVED_KEYS, "training.sync_every_old", "training.sync_every")
    config = loader.config_from_dict({"training": {"sync_every_old": 3}}, "x.toml")
    assert config.training.sync_every == 3
    err = capsys.readouterr().err
    assert "training.sync_every_old is now training.sync_every" in err and "x.toml" in err
    with pytest.raises(ConfigError, match="both set"):
        loader.config_from_dict({"training": {"sync_every_old": 3, "sync_every": 2}})
