"""Every config shipped in configs/ loads and names functions that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import load_config
from rollouts.engine_kinds import engine_kind
from rollouts.plugins import import_object
from rollouts.rewards.named import reward_path
from rollouts.rollout.filters import resolve_filters

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


def test_there_are_configs() -> None:
    names = {p.name for p in CONFIGS}
    assert {"demo-cpu.toml", "demo-tools-cpu.toml", "gpu-sglang.toml", "gpu-vllm.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_plugins_resolve(path: Path, capsys: pytest.CaptureFixture) -> None:
    config = load_config(path)
    assert "[config]" not in capsys.readouterr().err  # no key at an old place (MOVED_KEYS)
    reward = config.rollout.reward_fn if config.rollout.reward_fn != "judge" else ""  # [judge]
    for dotted in (reward and reward_path(reward), config.data.prepare, config.algorithm.schedule):
        if dotted:
            assert callable(import_object(dotted)), dotted
    assert len(resolve_filters(config.rollout.filters)) == len(config.rollout.filters)
    if not engine_kind(config.engines.kind).started_here:  # servers of their own
        assert config.engines.urls
        assert config.training.backend == "fsdp"
