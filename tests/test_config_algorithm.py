"""[algorithm] and its sub-tables, [reward]: every flat key of the last release still works for
one release, read at its new place with a line naming the new key (issue 28)."""

from __future__ import annotations

import functools
import typing
from pathlib import Path

import pytest

from rollouts.algorithms.advantages import ESTIMATORS
from rollouts.algorithms.policy_loss import POLICY_LOSSES
from rollouts.config import ADVANTAGES, AlgorithmConfig, ConfigError, config_from_dict, load_config
from rollouts.config.algorithm import ALGORITHM_MOVED_KEYS, PolicyLossName

# one valid, non-default value for every key that moved (together a valid [algorithm] table)
OLD_VALUES: dict[str, object] = {
    "kl_coef": 0.3,
    "kl_estimator": "k1",
    "kl_in": "reward",
    "kl_target": 0.02,
    "kl_horizon": 5,
    "kl_cap": 0.5,
    "kl_ignore_ref_above": 0.9,
    "ref_update": "ema",
    "ref_ema_decay": 0.5,
    "ref_update_every": 3,
    "ref_update_fn": "tests.algorithms.test_reference_schedule.half_way",
    "lam": 0.9,
    "value_coef": 0.25,
    "value_clip": 0.3,
    "value_lr": 0.01,
    "tis": True,
    "tis_cap": 1.5,
    "tis_level": "sequence",
    "rollout_rs": "token",
    "rollout_rs_threshold": 3.0,
    "rollout_rs_threshold_lower": 0.2,
    "cispo_clip_eps_low": 0.5,
    "cispo_clip_eps_high": 0.3,
    "pair_beta": 0.5,
    "pair_selector": "all_pairs_above_margin",
    "pair_margin": 0.1,
    "reward_transform": "relative",
    "reward_scope": "batch",
    "reward_weights": [1.0, 0.5],
    "pareto_mode": "distance",
    "reward_norm": "group",
    "overlong_buffer": 4,
    "overlong_max_length": 16,
    "overlong_penalty": 2.0,
    "efficiency_coef": 0.1,
}


def _at(config: object, path: str) -> object:
    return functools.reduce(getattr, path.split("."), config)


def test_every_old_algorithm_key_works_at_its_old_place_and_names_the_new_one(capsys) -> None:
    assert {f"algorithm.{k}" for k in OLD_VALUES} == set(ALGORITHM_MOVED_KEYS)
    config = config_from_dict({"algorithm": dict(OLD_VALUES)}, "old.toml")
    err = capsys.readouterr().err
    for old, new in ALGORITHM_MOVED_KEYS.items():
        assert _at(config, new) == OLD_VALUES[old.removeprefix("algorithm.")], (old, new)
        assert f"[config] {old} is now {new}: the old key works until the next release" in err
    assert err.count("old.toml") == len(ALGORITHM_MOVED_KEYS)


def test_an_old_key_works_from_a_file_and_from_set(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\nkl_coef = 0.1\nref_update = "copy"\n')
    config = load_config(path, ["algorithm.pair_beta=0.2"])
    assert (config.algorithm.kl.coef, config.algorithm.reference.update) == (0.1, "copy")
    assert config.algorithm.pairwise.beta == 0.2
    err = capsys.readouterr().err
    assert "algorithm.pair_beta is now algorithm.pairwise.beta" in err
    with pytest.raises(ConfigError, match="algorithm.kl_coef and algorithm.kl.coef are both set"):
        config_from_dict({"algorithm": {"kl_coef": 0.1, "kl": {"coef": 0.2}}})


def test_a_key_exists_only_in_its_table() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.kl.beta: unknown key"):
        config_from_dict({"algorithm": {"kl": {"beta": 0.1}}})
    with pytest.raises(ConfigError, match=r"algorithm.kl.into = 'los': must be one of"):
        config_from_dict({"algorithm": {"kl": {"into": "los"}}})
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss = 'dpo': must be one of"):
        AlgorithmConfig(policy_loss="dpo")  # type: ignore[arg-type]


def test_the_registries_hold_exactly_the_configs_names() -> None:
    assert set(POLICY_LOSSES) == set(typing.get_args(PolicyLossName))
    assert set(ESTIMATORS) | {"gae"} == set(ADVANTAGES)


def test_distillation_and_its_teacher_need_each_other() -> None:
    """advantage = "distill" without a teacher, a teacher nobody uses, a teacher's engines
    named at their own key path, and the reverse KL of scaled logprobs at T != 1: refused."""
    with pytest.raises(ConfigError, match=r"advantage = 'distill' needs a teacher"):
        config_from_dict({"algorithm": {"advantage": "distill"}})
    with pytest.raises(ConfigError, match=r"teacher.path / teacher.source is set but"):
        config_from_dict({"teacher": {"path": "/x"}})
    with pytest.raises(ConfigError) as bad:
        config_from_dict(
            {
                "algorithm": {"advantage": "distill", "distill": {"task_advantage": "gae"}},
                "teacher": {"path": "/x", "engines": {"kind": "vllm", "max_retries": -1}},
            }
        )
    problems = bad.value.problems
    assert "teacher.engines.max_retries: must be >= 0" in problems
    assert any(p.startswith("teacher.engines.urls: must list") for p in problems)
    assert any(p.startswith("algorithm.distill.task_advantage = 'gae'") for p in problems)
    with pytest.raises(ConfigError, match=r"algorithm.distill.top_k = 21: must be in \[0, 20\]"):
        config_from_dict(
            {
                "algorithm": {"advantage": "distill", "distill": {"top_k": 21}},
                "teacher": {"path": "/x"},
            }
        )
    with pytest.raises(ConfigError, match=r"temperature-scaled distribution"):
        config_from_dict(
            {
                "algorithm": {"advantage": "distill"},
                "teacher": {"path": "/x"},
                "engines": {"builtin": {"logprobs_from": "scaled"}},
                "rollout": {"sampling": {"temperature": 0.7}},
            }
        )
    ok = config_from_dict({"algorithm": {"advantage": "distill"}, "teacher": {"path": "/x"}})
    assert ok.teacher.enabled and ok.algorithm.distill.coef == 1.0


def test_a_judge_reward_and_its_judge_need_each_other() -> None:
    with pytest.raises(ConfigError, match=r"reward_fn = 'judge' needs a judge"):
        config_from_dict({"rollout": {"reward_fn": "judge"}})
    with pytest.raises(ConfigError, match=r"nothing would ask the judge"):
        config_from_dict({"judge": {"path": "/j"}})
    with pytest.raises(ConfigError) as bad:
        config_from_dict(
            {
                "rollout": {"reward_fn": "judge"},
                "judge": {"path": "/j", "pattern": "Score: (", "template": "grade it"},
            }
        )
    problems = " ".join(bad.value.problems)
    assert "judge.pattern = 'Score: (': not a regular expression" in problems
    assert "judge.template: has no ['{response}'] placeholder" in problems
    ok = config_from_dict({"rollout": {"reward_fn": "judge"}, "judge": {"path": "/j"}})
    assert ok.judge.enabled and ok.judge.score_max == 10.0
