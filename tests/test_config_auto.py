"""The "auto" speed keys (rollouts/config/auto.py): each rule, and an explicit setting winning."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import Config, auto, config_from_dict
from rollouts.driver.engines import builtin_spec


def _config(**sections: dict) -> Config:
    return config_from_dict(sections)


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "cpu_has_bf16", lambda: True)


@pytest.fixture
def plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "cpu_has_bf16", lambda: False)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse avx512f avx512_bf16 avx512_vnni", True),
        ("fpu sse amx_bf16 amx_tile", True),
        ("fpu sse avx512f avx512_vnni", False),  # AVX-512 without its bf16 instructions
    ],
)
def test_bf16_units_are_read_from_the_cpu_flags(
    tmp_path: Path, flags: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n")
    assert auto.cpu_flags_bf16(str(info)) is expected
    assert auto.cpu_flags_bf16(str(tmp_path / "absent")) is False
    monkeypatch.setenv(auto.CPU_BF16_ENV, "1")  # the override wins over the flags
    assert auto.cpu_has_bf16() is True
    monkeypatch.setenv(auto.CPU_BF16_ENV, "0")
    assert auto.cpu_has_bf16() is False
    monkeypatch.setenv(auto.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="ROLLOUTS_CPU_BF16='yes': set it to 0 or 1"):
        auto.cpu_has_bf16()


def test_training_autocast_auto_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    for has, cpu in ((True, True), (False, False)):
        monkeypatch.setattr(auto, "cpu_has_bf16", lambda has=has: has)
        assert auto.autocasts("auto", "cpu") is cpu
        assert auto.autocasts("auto", "cuda") is True
        assert auto.autocasts("off", "cuda") is False  # an explicit setting always wins
        assert auto.autocasts("bfloat16", "cpu") is True
        assert auto.trainer_autocasts(Config(), "cpu") is cpu  # the schema default is "auto"
        vllm = _config(engines={"kind": "vllm", "urls": ["http://127.0.0.1:1"]})
        assert auto.trainer_autocasts(vllm, "cpu") is False  # servers at URLs keep their dtype
        assert auto.trainer_autocasts(vllm, "cuda") is True


def test_the_runs_engines_compute_as_the_trainer_does(bf16_cpu: None, tmp_path: Path) -> None:
    cpu = {"training": {"device": "cpu"}}
    config = _config(**cpu)
    b = config.engines.builtin
    assert (auto.engine_dtype(config, b), auto.engine_autocast(config, b)) == ("bfloat16", "off")
    spec = builtin_spec(config, tmp_path, "v0", (), None)
    assert (spec.options.dtype, spec.options.autocast) == ("bfloat16", "off")
    assert spec.options.attn_implementation == "eager"
    assert auto.engine_numerics(config, b) == "bfloat16"  # the content check's tolerance
    # fp32 weights set by hand: "auto" autocast computes as the trainer
    fp32_weights = _config(**cpu, engines={"builtin": {"dtype": "float32"}})
    spec = builtin_spec(fp32_weights, tmp_path, "v0", (), None)
    assert (spec.options.dtype, spec.options.autocast) == ("float32", "bfloat16")
    # an autocast asked of the engine needs fp32 weights: "auto" dtype gives them
    asked = _config(**cpu, engines={"builtin": {"autocast": "bfloat16"}})
    assert auto.engine_dtype(asked, asked.engines.builtin) == "float32"
    # a trainer in fp32: the engines in the trainer's model.dtype, no autocast
    fp32 = _config(training={"device": "cpu", "autocast": "off"})
    assert auto.engine_numerics(fp32, fp32.engines.builtin) == "float32"
    pinned = _config(**cpu, engines={"builtin": {"dtype": "float32", "autocast": "off"}})
    spec = builtin_spec(pinned, tmp_path, "v0", (), None)
    assert (spec.options.dtype, spec.options.autocast) == ("float32", "off")


def test_a_cpu_without_bf16_units_trains_and_serves_fp32(plain_cpu: None) -> None:
    config = _config(training={"device": "cpu"})
    assert not auto.trainer_autocasts(config, "cpu")
    assert auto.engine_numerics(config, config.engines.builtin) == "float32"
    assert "training.autocast = off (CPU bf16 units: False)" in auto.chosen(config)


def test_attention_layout_and_micro_batch_rules() -> None:
    assert (auto.attention("auto", "cpu"), auto.attention("auto", "cuda")) == ("eager", "sdpa")
    assert auto.attention("sdpa", "cpu") == "sdpa"
    cpu_sizes = [auto.micro_batch_tokens(0, "cpu", h) for h in (16, 128, 576, 2048, 8192)]
    assert cpu_sizes == [16384, 8192, 2048, 512 * 2, 1024]  # 2^20 / hidden, within 1k..16k
    assert auto.micro_batch_tokens(0, "cpu") == 4096  # the hidden size unknown
    assert auto.micro_batch_tokens(0, "cuda", 128) == 4096
    assert auto.micro_batch_tokens(512, "cpu", 128) == 512  # an explicit size wins
    assert auto.micro_batch_layout(_config(training={"device": "cpu"})) == "prefix"  # groups
    not_prefix = [
        {"training": {"device": "cuda"}},  # not measured there
        {"rollout": {"n_samples_per_prompt": 1}, "training": {"device": "cpu"}},
        {"training": {"backend": "fsdp", "nproc": 2, "device": "cpu"}},
        {"model": {"gradient_checkpointing": True}, "training": {"device": "cpu"}},
        {"training": {"micro_batch_layout": "pack", "device": "cpu"}},
    ]
    for sections in not_prefix:
        assert auto.micro_batch_layout(_config(**sections)) != "prefix", sections


def test_the_run_says_what_each_auto_key_became(bf16_cpu: None) -> None:
    line = auto.chosen(_config(training={"device": "cpu"}))
    for part in (
        "training.autocast = bfloat16",
        "model.attn_implementation = eager",
        "training.micro_batch_tokens = 2^20 / the hidden size",
        "training.micro_batch_layout = prefix",
        "engines.builtin.dtype = bfloat16",
        "engines.builtin.autocast = off",
    ):
        assert part in line, line
    explicit = {
        "model": {"attn_implementation": "sdpa"},
        "training": {
            "device": "cpu",
            "autocast": "off",
            "micro_batch_tokens": 4096,
            "micro_batch_layout": "pad",
        },
        "engines": {"builtin": {"dtype": "float32", "autocast": "off"}},
    }
    assert auto.chosen(_config(**explicit)) == ""
    tiny = _config(
        training={"device": "cpu"}, model={"tiny": {"enabled": True, "hidden_size": 128}}
    )
    assert "training.micro_batch_tokens = 8192" in auto.chosen(tiny)  # its hidden size, 128


def _numerics(config: Config) -> tuple:
    """What each part of a run computes in: the trainer (RL, SFT) and each engine it starts."""
    import dataclasses

    sft = dataclasses.replace(config, training=config.training.for_sft())
    parts = [auto.trainer_autocasts(config, "cpu"), auto.trainer_autocasts(sft, "cpu")]
    for section in (config, config.teacher, config.judge):
        if section is config or section.enabled:
            served = dataclasses.replace(config, engines=section.engines)
            parts.append(auto.engine_numerics(served, section.engines.builtin))
    return tuple(parts)


CPU_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*-cpu.toml"))


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.name)
def test_a_shipped_cpu_config_runs_bf16_only_where_the_cpu_has_bf16_units(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The configs are tuned on a CPU with AVX-512 BF16, and there they compute in bf16; on one
    without (a Zen 3 EPYC: bf16 matmuls at 10 GFLOP/s a core against fp32's 85) in fp32."""
    from rollouts.config import load_config

    config = load_config(path)
    monkeypatch.setattr(auto, "cpu_has_bf16", lambda: False)
    plain = _numerics(config)
    assert set(plain) <= {False, "float32"}, plain
    assert auto.emulated_bf16(config) == ""
    monkeypatch.setattr(auto, "cpu_has_bf16", lambda: True)
    bf16 = _numerics(config)
    assert bf16[0] is True and set(bf16[2:]) == {"bfloat16"}, bf16


def test_an_explicit_bf16_on_a_cpu_without_bf16_units_is_named(plain_cpu: None) -> None:
    config = _config(training={"device": "cpu", "autocast": "bfloat16"})
    assert auto.trainer_autocasts(config, "cpu")  # an explicit setting still wins
    slow = auto.emulated_bf16(config)
    assert 'training.autocast = "bfloat16"' in slow
    assert "engines.builtin (auto: as training.autocast)" in slow  # the engines follow it
    assert "ROLLOUTS_CPU_BF16=1" in slow and 'Set them to "auto"' in slow
    engine = _config(training={"device": "cpu"}, engines={"builtin": {"dtype": "bfloat16"}})
    assert auto.emulated_bf16(engine).count("bfloat16") == 1
    assert 'engines.builtin.dtype = "bfloat16"' in auto.emulated_bf16(engine)
    assert auto.emulated_bf16(_config(training={"device": "cpu"})) == ""


def test_an_explicit_bf16_on_a_cpu_with_bf16_units_is_not_named(bf16_cpu: None) -> None:
    assert auto.emulated_bf16(_config(training={"device": "cpu", "autocast": "bfloat16"})) == ""


def test_rollouts_serve_says_when_bf16_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollouts.config import EngineOptions
    from rollouts.engine import cli

    monkeypatch.setattr(cli, "cpu_has_bf16", lambda: False)
    slow = cli.emulated_bf16(EngineOptions(dtype="bfloat16"))
    assert "--dtype bfloat16 on a CPU without bf16 matmul units" in slow
    assert "--autocast bfloat16" in cli.emulated_bf16(EngineOptions(autocast="bfloat16"))
    assert cli.emulated_bf16(EngineOptions()) == ""  # "auto": float32 standalone
    assert cli.emulated_bf16(EngineOptions(dtype="bfloat16", device="cuda")) == ""
    monkeypatch.setattr(cli, "cpu_has_bf16", lambda: True)
    assert cli.emulated_bf16(EngineOptions(dtype="bfloat16")) == ""
