from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from rollouts.config import (
    Config,
    ConfigError,
    EnginesConfig,
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

    monkeypatch.setitem(loader.MOVED_KEYS, "training.rl_steps_old", "training.rl_steps")
    config = loader.config_from_dict({"training": {"rl_steps_old": 3}}, "x.toml")
    assert config.training.rl_steps == 3
    err = capsys.readouterr().err
    assert "training.rl_steps_old is now training.rl_steps" in err and "x.toml" in err
    with pytest.raises(ConfigError, match="both set"):
        loader.config_from_dict({"training": {"rl_steps_old": 3, "rl_steps": 2}})
    with pytest.raises(ConfigError, match="both set"):  # a sub-table, given the new way
        loader.config_from_dict(
            {"weight_sync": {"bucket_mb": 1.0, "distributed": {"bucket_mb": 2.0}}}
        )
    with pytest.raises(ConfigError, match="weight_sync.distributed is not a table"):
        loader.config_from_dict({"weight_sync": {"bucket_mb": 1.0, "distributed": 3}})


def test_a_mode_value_is_checked_against_its_literal_read_or_built() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rollout": {"mode": "asnyc"}, "logging": {"wandb_mode": 1}})
    text = str(info.value)
    assert (
        "rollout.mode = 'asnyc': must be one of ['sync', 'async'] (did you mean 'async'?)" in text
    )
    assert "logging.wandb_mode = 1: must be one of ['offline', 'online', 'disabled']" in text
    with pytest.raises(ConfigError, match=r"engines.kind = 'vlm': must be one of \['builtin'"):
        EnginesConfig(kind="vlm", urls=["http://a:1"])  # built in code: the same check


def _sections(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            path = f"{prefix}{field.name}"
            yield path, hints[field.name]
            yield from _sections(hints[field.name], f"{path}.")


def test_each_section_with_a_mode_knows_its_key_path() -> None:
    found = dict(_sections(Config))
    assert "rollout.sampling" in found and "model.tiny" in found
    for path, cls in found.items():
        has_mode = any(
            typing.get_origin(t) is typing.Literal for t in typing.get_type_hints(cls).values()
        )
        # a section reused under another ([teacher.engines] is [engines]) keeps its KEY; the
        # loader names its problems at the path it was read at (test_config_algorithm.py)
        reused = path.endswith(f".{cls.KEY}")
        assert path == cls.KEY or reused or (not cls.KEY and not has_mode), (path, cls.KEY)


OLD_KEYS = {  # old dotted path -> (a value, where it is read now)
    "training.sync_every": (2, lambda c: c.weight_sync.every),
    "training.weight_sync_dir": ("/tmp/w", lambda c: c.weight_sync.dir),
    "training.weight_sync_attempts": (5, lambda c: c.weight_sync.attempts),
    "weight_sync.backend": ("gloo", lambda c: c.weight_sync.distributed.backend),
    "weight_sync.bucket_mb": (64.0, lambda c: c.weight_sync.distributed.bucket_mb),
    "weight_sync.master_address": ("10.0.0.1", lambda c: c.weight_sync.distributed.master_address),
    "weight_sync.master_port": (29500, lambda c: c.weight_sync.distributed.master_port),
    "weight_sync.group_name": ("g", lambda c: c.weight_sync.distributed.group_name),
    "weight_sync.timeout_s": (60.0, lambda c: c.weight_sync.distributed.timeout_s),
    "engines.num_engines": (2, lambda c: c.engines.builtin.num_engines),
    "engines.max_batch": (8, lambda c: c.engines.builtin.max_batch),
    "engines.max_queue": (16, lambda c: c.engines.builtin.max_queue),
    "engines.logprobs_from": ("scaled", lambda c: c.engines.builtin.logprobs_from),
    "engines.device": ("cuda:1", lambda c: c.engines.builtin.device),
    "engines.torch_threads": (1, lambda c: c.engines.builtin.torch_threads),
    "engines.max_restarts": (0, lambda c: c.engines.builtin.max_restarts),
}


@pytest.mark.parametrize("old", sorted(OLD_KEYS))
def test_every_old_key_still_works_and_names_its_new_place(old: str, capsys, tmp_path) -> None:
    from rollouts.config.loader import MOVED_KEYS

    value, read = OLD_KEYS[old]
    section, key = old.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{key} = {json.dumps(value)}\n")
    assert read(load_config(path)) == value
    assert f"[config] {old} is now {MOVED_KEYS[old]}" in capsys.readouterr().err
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert read(load_config(empty, [f"{old}={json.dumps(value)}"])) == value  # in --set too


def test_the_old_keys_are_exactly_the_moved_ones() -> None:
    from rollouts.config.loader import MOVED_KEYS

    assert set(OLD_KEYS) == set(MOVED_KEYS)


def test_engines_sleep_needs_sync_mode_and_a_sync_every_step() -> None:
    assert config_from_dict({}).engines.sleep_level == 0
    ok = config_from_dict({"engines": {"sleep_level": 2}, "rollout": {"mode": "sync"}})
    assert ok.engines.sleep_level == 2
    with pytest.raises(ConfigError, match=r"engines.sleep_level = 3: must be 0 \(awake\), 1 or 2"):
        config_from_dict({"engines": {"sleep_level": 3}})
    with pytest.raises(ConfigError, match="set rollout.mode = 'sync'"):
        config_from_dict({"engines": {"sleep_level": 1}, "rollout": {"mode": "async"}})
    with pytest.raises(ConfigError, match="set weight_sync.every = 1"):
        every_2 = {"engines": {"sleep_level": 1}, "weight_sync": {"every": 2}}
        config_from_dict(every_2 | {"rollout": {"mode": "sync"}})


def test_automatic_concurrency_is_the_built_in_engines_capacity() -> None:
    from rollouts.config.rollout import EXTERNAL_CONCURRENCY, resolved_concurrency

    def resolved(raw: dict) -> int:
        config = config_from_dict(raw)
        return resolved_concurrency(config.rollout, config.engines)

    # 10 groups of 8 under a bound of 64 ran their last 2 groups after the first 8 finished
    two = {"engines": {"builtin": {"num_engines": 2, "max_batch": 128}}}
    assert resolved(two) == 256
    assert resolved({**two, "rollout": {"max_concurrency": 48}}) == 48  # as set
    vllm = {"engines": {"kind": "vllm", "urls": ["http://h:1"]}}
    assert resolved(vllm) == EXTERNAL_CONCURRENCY
    with pytest.raises(ConfigError, match="rollout.max_concurrency"):
        config_from_dict({"rollout": {"max_concurrency": -1}})


def test_rollout_correction_refuses_engine_logprobs_of_the_scaled_distribution() -> None:
    """TIS / rejection weigh each token by pi_trainer / pi_engine; the trainer's logprobs are of
    the raw logits, so an engine reporting log softmax(logits / T) would skew every weight."""
    from rollouts.config.rollout import engine_logprobs

    sglang = {"kind": "sglang", "urls": ["http://h:1"]}
    vllm = {"kind": "vllm", "urls": ["http://h:1"]}
    tis = {"algorithm": {"rollout_correction": {"tis": True}}}
    at_07 = {"rollout": {"sampling": {"temperature": 0.7}}}
    # each server's own default: SGLang scaled, vLLM raw; the built-in engines as configured
    assert engine_logprobs(config_from_dict({"engines": sglang}).engines) == "scaled"
    assert engine_logprobs(config_from_dict({"engines": vllm}).engines) == "raw"
    assert engine_logprobs(config_from_dict({}).engines) == "raw"

    with pytest.raises(ConfigError) as info:
        config_from_dict({"engines": sglang} | tis | at_07)
    message = str(info.value)
    assert "rollout.sampling.temperature = 0.7" in message
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB=1" in message
    assert "engines.served_logprobs = 'raw'" in message
    rejection = {"algorithm": {"rollout_correction": {"rejection": "token"}}}
    with pytest.raises(ConfigError, match="rejection = 'token'"):
        config_from_dict({"engines": sglang} | rejection | at_07)
    scaled_builtin = {"engines": {"builtin": {"logprobs_from": "scaled"}}}
    with pytest.raises(ConfigError, match="set engines.builtin.logprobs_from = 'raw'"):
        config_from_dict(scaled_builtin | tis | at_07)
    scaled_vllm = {"engines": vllm | {"served_logprobs": "scaled"}}
    with pytest.raises(ConfigError, match="--logprobs-mode raw_logprobs"):
        config_from_dict(scaled_vllm | tis | at_07)

    # what runs: raw logprobs declared, vLLM's default, temperature 1 (or greedy), no correction
    config_from_dict({"engines": sglang | {"served_logprobs": "raw"}} | tis | at_07)
    config_from_dict({"engines": vllm} | tis | at_07)
    config_from_dict({"engines": sglang} | tis)  # temperature 1.0: the same distribution
    config_from_dict({"engines": sglang} | tis | {"rollout": {"sampling": {"temperature": 0}}})
    config_from_dict({"engines": sglang} | at_07)
    config_from_dict(scaled_builtin | at_07)
    with pytest.raises(ConfigError, match="engines.builtin.logprobs_from"):
        config_from_dict({"engines": {"served_logprobs": "raw"}})
