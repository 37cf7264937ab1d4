"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE, REINFORCE++ (plain and baseline), GAE,
and on-policy distillation's per-token reverse KL against a teacher.

Input: groups of scored Samples (one group = the samples of one prompt). Output: one float tensor
per sample, aligned with `sample.tokens` (length len(tokens)), zero wherever `loss_mask` is 0.
Definitions follow /work/shared/reference/algorithms.md. Token-level rewards (an outcome score at
the last trained token, minus an optional per-token KL penalty) drive the per-token estimators;
observation (tool output) tokens have loss_mask 0 and are skipped: they are not steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from rollouts.algorithms.aggregation import masked_whiten
from rollouts.algorithms.tensors import flat_views, mask_tensor, mask_views
from rollouts.config import AlgorithmConfig
from rollouts.types import Sample, Status

GRPO_EPS = 1e-6  # verl / slime / SkyRL
Groups = Sequence[Sequence[Sample]]
PerToken = tuple[tuple[torch.Tensor, ...], ...]  # [group][sample] -> [len(tokens)]


def scalar_reward(sample: Sample) -> float:
    """The sample's reward as a float; vector rewards must be aggregated first (rewards module)."""
    assert sample.status is not Status.FAILED, f"sample {sample.index} FAILED: never trained on"
    if sample.reward is None or isinstance(sample.reward, tuple):
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}) has reward {sample.reward!r}: "
            "advantages need a float; score it first and aggregate vector rewards "
            "(rollouts.rewards.computers.aggregate_vector)"
        )
    return float(sample.reward)


def mask_of(sample: Sample) -> torch.Tensor:
    """The sample's loss mask as a float tensor [len(tokens)]."""
    return mask_tensor(sample.loss_mask)


def outcome_token_rewards(
    groups: Groups, penalties: PerToken | None = None, scores: Sequence[Sequence[float]] = ()
) -> PerToken:
    """Per-token rewards: the score at the last trained token, minus `penalties` (e.g. beta * KL).

    `scores` overrides the samples' rewards (same nesting). A sample with no trained token gets
    all zeros.
    """
    out = []
    for g, group in enumerate(groups):
        row = []
        for i, sample in enumerate(group):
            rewards = torch.zeros(len(sample.loss_mask), dtype=torch.float32)
            last = last_trained(sample.loss_mask)
            if last is not None:
                rewards[last] = scores[g][i] if scores else scalar_reward(sample)
            if penalties is not None:
                mask = mask_of(sample)
                assert penalties[g][i].shape == mask.shape, f"{penalties[g][i].shape=}"
                rewards = rewards - penalties[g][i] * mask
            row.append(rewards)
        out.append(tuple(row))
    return tuple(out)


def last_trained(loss_mask: Sequence[int]) -> int | None:
    """The index of the last trained token (the last 1 of the mask), None when none is: a
    search of the tuple, not a tensor made for it."""
    try:
        return len(loss_mask) - 1 - loss_mask[::-1].index(1)
    except ValueError:
        return None


def grpo_scores(scores_G: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO advantages of one group, as verl `compute_grpo_outcome_advantage`.

    A_i = (s_i - mean) / (std + 1e-6), std unbiased (N-1); without std (Dr.GRPO) A_i = s_i - mean.
    A group of one has mean 0 and std 1 (so A = s / (1 + 1e-6), or s without std).
    """
    assert scores_G.ndim == 1, f"{scores_G.shape=}"
    assert len(scores_G) >= 1, "a group must hold at least one sample"
    if len(scores_G) == 1:
        mean, std = torch.zeros(()), torch.ones(())
    else:
        mean, std = scores_G.mean(), scores_G.std(unbiased=True)
    return (scores_G - mean) / (std + GRPO_EPS) if norm_by_std else scores_G - mean


def rloo_scores(scores_G: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = s_i - mean of the OTHER samples of the group; a group of one keeps A = s."""
    assert scores_G.ndim == 1, f"{scores_G.shape=}"
    n = len(scores_G)
    if n == 1:
        return scores_G.clone()
    return scores_G - (scores_G.sum() - scores_G) / (n - 1)


def discounted_returns(rewards_T: torch.Tensor, mask_T: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over trained tokens only: G_t = r_t + gamma * G_next (untrained tokens -> 0)."""
    assert rewards_T.shape == mask_T.shape, f"{rewards_T.shape=} != {mask_T.shape=}"
    out = torch.zeros_like(rewards_T)
    running = 0.0
    for t in reversed(mask_T.nonzero().flatten().tolist()):
        running = float(rewards_T[t]) + gamma * running
        out[t] = running
    return out


def gae(
    rewards_T: torch.Tensor, values_T: torch.Tensor, mask_T: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over trained tokens (verl `compute_gae_advantage_return`, observation tokens skipped).

    delta_t = r_t + gamma * V_next - V_t ; A_t = delta_t + gamma * lam * A_next, where "next" is
    the next TRAINED token (V = 0 after the last). Returns (advantages, returns = A + V),
    unwhitened.
    """
    assert rewards_T.shape == values_T.shape == mask_T.shape, f"{rewards_T.shape=}"
    adv = torch.zeros_like(rewards_T)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(mask_T.nonzero().flatten().tolist()):
        delta = float(rewards_T[t]) + gamma * next_value - float(values_T[t])
        next_adv = delta + gamma * lam * next_adv
        next_value = float(values_T[t])
        adv[t] = next_adv
    return adv, (adv + values_T) * mask_T


def _whiten_all(per_token: PerToken, groups: Groups) -> PerToken:
    """Whiten every trained token of the batch together (one mean and std for the batch)."""
    masks = [mask_of(s) for group in groups for s in group]
    flat = torch.cat([a for row in per_token for a in row]) if masks else torch.zeros(0)
    white = masked_whiten(flat, torch.cat(masks)) if masks else flat
    out, start = [], 0
    for row in per_token:
        new_row = []
        for a in row:
            new_row.append(white[start : start + len(a)])
            start += len(a)
        out.append(tuple(new_row))
    return tuple(out)


def _broadcast(groups: Groups, seq_adv: Sequence[torch.Tensor]) -> PerToken:
    """Each sample's sequence advantage on its trained tokens (`float(A_i) * mask`), for the
    whole batch in one buffer cut into per-sample views."""
    samples = [s for group in groups for s in group]
    if not samples:
        return tuple(() for _ in groups)
    per_sample = torch.cat([a.reshape(-1) for a in seq_adv]).tolist()
    assert len(per_sample) == len(samples), f"{len(per_sample)=} != {len(samples)=}"
    masks = mask_views([s.loss_mask for s in samples])
    views = flat_views(torch.empty(sum(len(m) for m in masks)), [len(m) for m in masks])
    for mask, a, view in zip(masks, per_sample, views, strict=True):
        torch.mul(mask, a, out=view)
    out, start = [], 0
    for group in groups:
        out.append(views[start : start + len(group)])
        start += len(group)
    return tuple(out)


def _seq_scores(groups: Groups, token_rewards: PerToken | None) -> list[torch.Tensor]:
    """A sequence's score is the sum of its token rewards (verl: token_level_rewards.sum(-1)).
    With outcome rewards (None) that sum is the reward, as float32, where the sample has a
    trained token (else 0): read from the samples, without making per-token rewards."""
    if token_rewards is None:
        return [
            torch.tensor(torch.tensor([_outcome(s) for s in g], dtype=torch.float32).tolist())
            for g in groups
        ]
    return [torch.tensor([float(r.sum()) for r in row]) for row in token_rewards]


def _outcome(sample: Sample) -> float:
    # + 0.0: the sum of the zeros and a reward of -0.0 is 0.0
    return scalar_reward(sample) + 0.0 if 1 in sample.loss_mask else 0.0


def _per_token(groups: Groups, token_rewards: PerToken | None) -> PerToken:
    return token_rewards if token_rewards is not None else outcome_token_rewards(groups)


def compute_gae(
    groups: Groups, values: PerToken, config: AlgorithmConfig, token_rewards: PerToken | None = None
) -> tuple[PerToken, PerToken]:
    """GAE advantages (whitened over the batch's trained tokens) and returns, for a critic."""
    rewards = token_rewards if token_rewards is not None else outcome_token_rewards(groups)
    adv, ret = [], []
    for g, group in enumerate(groups):
        pairs = [
            gae(rewards[g][i], values[g][i].float(), mask_of(s), config.gamma, config.gae.lam)
            for i, s in enumerate(group)
        ]
        adv.append(tuple(a for a, _ in pairs))
        ret.append(tuple(r for _, r in pairs))
    return _whiten_all(tuple(adv), groups), tuple(ret)


def needs_critic(config: AlgorithmConfig) -> bool:
    """Whether the advantage estimator needs a critic's values (GAE): the one place that asks."""
    return config.advantage == "gae"


def compute_advantages(
    groups: Groups,
    config: AlgorithmConfig,
    *,
    token_rewards: PerToken | None = None,
    values: PerToken | None = None,
) -> PerToken:
    """Per-token advantages of every sample, by `config.advantage` (names as verl's estimators).

    grpo (config.norm_adv_by_std), dr_grpo (no std), rloo: sequence scores broadcast over trained
    tokens. reinforce: discounted reward-to-go (gamma), no baseline, unwhitened.
    reinforce_plus_plus (verl `compute_reinforce_plus_plus_outcome_advantage`): discounted
    reward-to-go whitened over the batch's trained tokens, no group baseline.
    reinforce_plus_plus_baseline (alias reinforce_pp; verl's REINFORCE++-baseline): the group's
    mean score subtracted (mean 0 for a group of one, as verl), reward-to-go, then whitened over
    the batch (with gamma = 1 and outcome rewards this is exactly verl's). gae: needs `values`;
    use `compute_gae` to also get the returns. `token_rewards` default: `outcome_token_rewards`.
    """
    assert all(len(group) >= 1 for group in groups), "every group must hold a sample"
    rewards = token_rewards  # None: outcome rewards, made per token only where needed
    if needs_critic(config):
        if values is None:
            raise ValueError("algorithm.advantage = 'gae' needs critic values: pass values=")
        return compute_gae(groups, values, config, rewards)[0]
    return ESTIMATORS[config.advantage](groups, rewards, config)


def _grpo(groups: Groups, rewards: PerToken | None, config: AlgorithmConfig) -> PerToken:
    norm = config.norm_adv_by_std and config.advantage == "grpo"
    return _broadcast(groups, [grpo_scores(s, norm) for s in _seq_scores(groups, rewards)])


def _rloo(groups: Groups, rewards: PerToken | None, config: AlgorithmConfig) -> PerToken:
    return _broadcast(groups, [rloo_scores(s) for s in _seq_scores(groups, rewards)])


def _reinforce(groups: Groups, rewards: PerToken | None, config: AlgorithmConfig) -> PerToken:
    return _reward_to_go(groups, _per_token(groups, rewards), config.gamma)


def _reinforce_pp(groups: Groups, rewards: PerToken | None, config: AlgorithmConfig) -> PerToken:
    return _whiten_all(_reward_to_go(groups, _per_token(groups, rewards), config.gamma), groups)


def _reinforce_pp_baseline(
    groups: Groups, rewards: PerToken | None, config: AlgorithmConfig
) -> PerToken:
    rewards = _per_token(groups, rewards)
    means = [group_baseline(s) for s in _seq_scores(groups, rewards)]
    centred = tuple(
        tuple(rewards[g][i] + _last_token_value(mask_of(s), -means[g]) for i, s in enumerate(group))
        for g, group in enumerate(groups)
    )
    return _whiten_all(_reward_to_go(groups, centred, config.gamma), groups)


def distill_token_advantages(sample: Sample, coef: float) -> torch.Tensor:
    """On-policy distillation's advantage of each token [len(tokens)]: coef * -(log pi_student -
    log pi_teacher) on the sampled response tokens (the negative per-token reverse KL, as
    Thinking Machines' recipe and TRL's GKD at lambda = 1), 0 on the prompt and where
    `loss_mask` is 0 (a tool's output is not sampled)."""
    n = sample.response_length
    for name in ("rollout_logprobs", "teacher_logprobs"):
        if (k := len(getattr(sample, name))) != n:
            raise ValueError(
                f"sample {sample.index} (group {sample.group_index}) has {k} {name} for {n} "
                "response tokens: distillation needs the engine's logprob of each sampled token "
                "and the teacher's (a generate_fn must return rollout_logprobs)"
            )
    out = torch.zeros(len(sample.tokens), dtype=torch.float32)
    if n:
        student = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        teacher = torch.tensor(sample.teacher_logprobs, dtype=torch.float32)
        out[-n:] = coef * (teacher - student)
    return out * mask_of(sample)


def reverse_kl_per_token(groups: Groups) -> tuple[float, int]:
    """(the mean log pi_student - log pi_teacher over the trained response tokens of the
    samples the teacher scored, how many tokens); (nan, 0) when none was scored."""
    total, count = 0.0, 0
    for group in groups:
        for s in group:
            n = s.response_length
            if not n or len(s.teacher_logprobs) != n or len(s.rollout_logprobs) != n:
                continue
            mask = s.loss_mask[-n:]
            for m, st, te in zip(mask, s.rollout_logprobs, s.teacher_logprobs, strict=True):
                if m:
                    total += st - te
                    count += 1
    return (total / count if count else float("nan")), count


def _distill(groups: Groups, rewards: PerToken | None, config: AlgorithmConfig) -> PerToken:
    """coef x the reverse KL's advantage (0 with `top_k`: its term is in the loss), plus
    task_weight x the task reward's advantage (`algorithm.distill.task_advantage`, a
    critic-free estimator) when one is named."""
    d = config.distill
    if d.top_k:  # the teacher's top-k is learnt in the loss (loss_fn), not from an advantage
        out = tuple(tuple(torch.zeros(len(s.tokens)) for s in group) for group in groups)
    else:
        out = tuple(tuple(distill_token_advantages(s, d.coef) for s in group) for group in groups)
    if not d.task_advantage:
        return out
    task_config = dataclasses.replace(config, advantage=d.task_advantage)
    task = ESTIMATORS[d.task_advantage](groups, rewards, task_config)
    return tuple(
        tuple(a + d.task_weight * t for a, t in zip(row, task_row, strict=True))
        for row, task_row in zip(out, task, strict=True)
    )


# the critic-free estimators by name (GAE, which needs values, is `compute_gae`)
ESTIMATORS: dict[str, Callable[[Groups, PerToken | None, AlgorithmConfig], PerToken]] = {
    "grpo": _grpo,
    "dr_grpo": _grpo,
    "rloo": _rloo,
    "reinforce": _reinforce,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
    "reinforce_pp": _reinforce_pp_baseline,
    "distill": _distill,
}


def group_baseline(scores_G: torch.Tensor) -> float:
    """The REINFORCE++-baseline's group mean: 0 for a group of one (verl), else the mean.

    Subtracting a lone sample's own score would zero every advantage of an n = 1 run.
    """
    assert scores_G.ndim == 1, f"{scores_G.shape=}"
    assert len(scores_G) >= 1, "a group must hold at least one sample"
    return 0.0 if len(scores_G) == 1 else float(scores_G.mean())


def _reward_to_go(groups: Groups, rewards: PerToken, gamma: float) -> PerToken:
    return tuple(
        tuple(discounted_returns(rewards[g][i], mask_of(s), gamma) for i, s in enumerate(group))
        for g, group in enumerate(groups)
    )


def _last_token_value(mask: torch.Tensor, value: float) -> torch.Tensor:
    out = torch.zeros_like(mask)
    trained = mask.nonzero().flatten()
    if len(trained):
        out[trained[-1]] = value
    return out
