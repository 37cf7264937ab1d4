"""Reference-model strategies (none, copy, EMA, periodic, user) and algorithm schedules."""

from __future__ import annotations

import pytest
import torch

from rollouts.algorithms.reference import load_reference_, module_params, update_reference
from rollouts.algorithms.schedule import example_schedule, load_schedule
from rollouts.config import AlgorithmConfig, ConfigError, KLConfig, ReferenceConfig
from rollouts.plugins import PluginError

REF = {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([2.0])}
POL = {"w": torch.tensor([1.0, 3.0]), "b": torch.tensor([4.0])}


def half_way(ref_params, policy_params, step):
    """A user strategy: the mean of reference and policy."""
    return {k: (ref_params[k] + policy_params[k]) / 2 for k in ref_params}


def test_none_and_copy():
    assert update_reference(REF, POL, ReferenceConfig(update="none"), 1) is REF
    out = update_reference(REF, POL, ReferenceConfig(update="copy"), 1)
    assert out["w"].tolist() == [1.0, 3.0]
    assert out["w"] is not POL["w"]  # a clone, not an alias of the policy
    assert REF["w"].tolist() == [0.0, 1.0]  # inputs untouched


def test_ema():
    out = update_reference(REF, POL, ReferenceConfig(update="ema", ema_decay=0.9), 1)
    # .9 * ref + .1 * policy: w = (.9*0 + .1*1, .9*1 + .1*3) = (.1, 1.2); b = 1.8 + .4 = 2.2
    assert out["w"].tolist() == pytest.approx([0.1, 1.2])
    assert out["b"].tolist() == pytest.approx([2.2])


def test_periodic():
    config = ReferenceConfig(update="periodic", update_every=3)
    assert update_reference(REF, POL, config, 2) is REF
    assert update_reference(REF, POL, config, 3)["b"].tolist() == [4.0]
    assert update_reference(REF, POL, config, 4) is REF


def test_user_strategy_by_dotted_path():
    config = ReferenceConfig(update="user", update_fn=f"{__name__}.half_way")
    assert update_reference(REF, POL, config, 1)["w"].tolist() == [0.5, 2.0]
    with pytest.raises(ConfigError, match="algorithm.reference.update_fn"):
        ReferenceConfig(update="user")
    bad = ReferenceConfig(update="user", update_fn=f"{__name__}.nothing_here")
    with pytest.raises(PluginError, match="nothing_here"):
        update_reference(REF, POL, bad, 1)


def test_applied_to_modules():
    torch.manual_seed(0)
    ref, policy = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    new = update_reference(
        module_params(ref), module_params(policy), ReferenceConfig(update="copy"), 1
    )
    load_reference_(ref, new)
    assert torch.equal(ref.weight, policy.weight)
    assert torch.equal(ref.bias, policy.bias)


def test_schedules():
    same = AlgorithmConfig(kl=KLConfig(coef=0.3))
    assert load_schedule(same)(17) is same
    sched = load_schedule(AlgorithmConfig(schedule="rollouts.algorithms.schedule.example_schedule"))
    assert sched(0).kl.coef == 0.2
    assert sched(29).kl.coef == 0.2
    assert sched(30).kl.coef == 0.05
    dapo = sched(60)
    assert (dapo.kl.coef, dapo.clip_eps_high, dapo.loss_agg) == (0.0, 0.28, "token-mean")
    assert example_schedule(100) == dapo


def not_a_config(step):
    return {"kl_coef": 0.1}


def test_schedule_must_return_a_config():
    sched = load_schedule(AlgorithmConfig(schedule=f"{__name__}.not_a_config"))
    with pytest.raises(TypeError, match="must return an AlgorithmConfig"):
        sched(0)
