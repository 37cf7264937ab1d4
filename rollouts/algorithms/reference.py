"""Reference-model update strategies over parameter dicts: none, copy, EMA, periodic, user.

`update_reference(ref, policy, config, step)` is pure: it returns the NEW reference parameters
(a dict of tensors) and never touches its inputs, so it is tested without a model. The trainer
applies the result with `load_reference_(ref_module, new_params)` (in place, under no_grad).
A user strategy is a function `(ref_params, policy_params, step) -> new ref_params`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from rollouts.config import ReferenceConfig
from rollouts.plugins import load_function

Params = Mapping[str, torch.Tensor]


class ReferenceUpdateFn(Protocol):
    """A user reference strategy: the new reference parameters from the old ones and the policy."""

    def __call__(self, ref_params: Params, policy_params: Params, step: int) -> Params: ...


def _check_same_keys(ref: Params, policy: Params) -> None:
    missing = sorted(set(policy) - set(ref))[:5]
    extra = sorted(set(ref) - set(policy))[:5]
    assert not missing and not extra, f"reference/policy parameters differ: {missing=} {extra=}"


def copy_params(policy: Params) -> dict[str, torch.Tensor]:
    """A detached clone of the policy's parameters (a hard reset of the reference)."""
    return {k: v.detach().clone() for k, v in policy.items()}


def ema_params(ref: Params, policy: Params, decay: float) -> dict[str, torch.Tensor]:
    """ref <- decay * ref + (1 - decay) * policy, per parameter (computed in float32)."""
    assert 0.0 <= decay <= 1.0, f"{decay=} must be in [0, 1]"
    _check_same_keys(ref, policy)
    out = {}
    for k, r in ref.items():
        p = policy[k].detach().to(r.device).float()
        out[k] = (decay * r.detach().float() + (1.0 - decay) * p).to(r.dtype)
    return out


def reference_moves(config: ReferenceConfig) -> bool:
    """Whether the reference ever changes during a run (any strategy but "none")."""
    return config.update != "none"


def update_reference(
    ref: Params,
    policy: Params,
    config: ReferenceConfig,
    step: int,
    user_fn: Callable[..., Params] | None = None,
) -> Params:
    """The reference parameters after optimizer step `step` (1-based), by `config.update`
    ([algorithm.reference]).

    none: unchanged. copy: the policy's, every step. ema: decay * ref + (1 - decay) * policy.
    periodic: the policy's every `update_every` steps, else unchanged. user: `user_fn`
    (or the function `config.update_fn` names).
    """
    assert step >= 1, f"{step=} must be >= 1 (call after an optimizer step)"
    strategy = config.update
    if strategy == "none":
        return ref
    if strategy == "copy":
        _check_same_keys(ref, policy)
        return copy_params(policy)
    if strategy == "ema":
        return ema_params(ref, policy, config.ema_decay)
    if strategy == "periodic":
        _check_same_keys(ref, policy)
        return copy_params(policy) if step % config.update_every == 0 else ref
    assert strategy == "user", f"{strategy=}"
    fn = user_fn or load_function(config.update_fn, ReferenceUpdateFn)
    return fn(ref, policy, step)


@torch.no_grad()
def load_reference_(ref_module: torch.nn.Module, params: Params) -> None:
    """Copy `params` into `ref_module`'s parameters in place (no-op when they are its own)."""
    named = dict(ref_module.named_parameters())
    _check_same_keys(named, params)
    for k, p in named.items():
        if params[k] is not p:
            p.copy_(params[k])


def module_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters by name (the `Params` the functions above take)."""
    return dict(module.named_parameters())
