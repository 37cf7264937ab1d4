"""KL estimators (k1, abs, k2, k3), KL helpers, and KL in the reward (fixed or adaptive).

Estimators take per-token logprobs of the sampled tokens, d = logp - logp_ref, and follow verl's
`kl_penalty` (see /work/shared/reference/algorithms.md). Sampled from the policy, k1 and k3 are
unbiased estimates of the reverse KL(pi || ref); k3 is the low-variance one. `full_kl` gives the
exact per-token KL from logits, in either direction; `full_kl_chunked` does the same over the
trained positions of a [B, T, V] batch a chunk at a time (memory bounded by the chunk).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.utils.checkpoint

from rollouts.config import KL_ESTIMATORS, AlgorithmConfig, KLConfig

K3_CLAMP = 10.0
EXP_CLAMP = 20.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate by name, as verl `kl_penalty`.

    k1 ("kl"): d ; abs: |d| ; k2 ("mse"): 0.5 d^2 ;
    k3 ("low_var_kl"): x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10).
    """
    assert logp.shape == ref_logp.shape, f"{logp.shape=} != {ref_logp.shape=}"
    assert estimator in KL_ESTIMATORS, f"{estimator=} not in {KL_ESTIMATORS}"
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d * d
    x = torch.clamp(-d, -EXP_CLAMP, EXP_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1.0, -K3_CLAMP, K3_CLAMP)


def truncate_kl(
    kl: torch.Tensor, ref_logp: torch.Tensor, *, cap: float = 0.0, ignore_ref_above: float = 1.0
) -> torch.Tensor:
    """The truncated variant: zero where the reference is confident, cap per-token KL.

    Tokens the reference gives p_ref > `ignore_ref_above` carry no KL (1.0 = keep all); `cap` > 0
    clamps each token's KL to [-cap, cap] (0 = no cap).
    """
    assert kl.shape == ref_logp.shape, f"{kl.shape=} != {ref_logp.shape=}"
    assert 0.0 < ignore_ref_above <= 1.0, f"{ignore_ref_above=} must be in (0, 1]"
    if ignore_ref_above < 1.0:
        kl = torch.where(ref_logp.float() > math.log(ignore_ref_above), torch.zeros_like(kl), kl)
    if cap > 0.0:
        kl = torch.clamp(kl, -cap, cap)
    return kl


def config_kl(logp: torch.Tensor, ref_logp: torch.Tensor, config: KLConfig) -> torch.Tensor:
    """Per-token KL with [algorithm.kl]'s estimator, cap and confident-reference truncation."""
    kl = kl_estimate(logp, ref_logp, config.estimator)
    return truncate_kl(kl, ref_logp, cap=config.cap, ignore_ref_above=config.ignore_ref_above)


def full_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) per position from logits [..., V] -> [...].

    Reverse KL of the policy: full_kl(policy, ref); forward KL: full_kl(ref, policy).
    """
    assert logits_p.shape == logits_q.shape, f"{logits_p.shape=} != {logits_q.shape=}"
    logp = torch.log_softmax(logits_p.float(), dim=-1)
    logq = torch.log_softmax(logits_q.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def reverse_kl(policy_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(policy || ref) per position (mode-seeking; what k1/k3 estimate from samples)."""
    return full_kl(policy_logits, ref_logits)


def forward_kl(policy_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || policy) per position (mass-covering)."""
    return full_kl(ref_logits, policy_logits)


KL_DIRECTIONS = ("reverse", "forward")


def _kl_rows(
    policy_flat: torch.Tensor, ref_flat: torch.Tensor, rows: torch.Tensor, direction: str
) -> torch.Tensor:
    """KL of the selected rows of [N, V] logits (log_softmax of only those rows) -> [len(rows)]."""
    logp = torch.log_softmax(policy_flat[rows].float(), dim=-1)
    logq = torch.log_softmax(ref_flat[rows].float(), dim=-1)
    if direction == "forward":
        logp, logq = logq, logp
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def full_kl_chunked(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    direction: str = "reverse",
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Exact per-token KL from logits [..., V], computed `chunk_size` trained positions at a time.

    reverse: KL(policy || ref) (what k1/k3 estimate); forward: KL(ref || policy). Only positions
    with mask != 0 are computed (others are 0), so the [.., V] log-softmaxes exist one chunk at a
    time. Under autograd each chunk is recomputed in backward (activation checkpointing), so the
    memory kept for backward is the logits themselves, not two log-softmaxes of [B, T, V].
    """
    assert policy_logits.shape == ref_logits.shape, f"{policy_logits.shape=} != {ref_logits.shape=}"
    assert mask.shape == policy_logits.shape[:-1], f"{mask.shape=} vs {policy_logits.shape=}"
    assert direction in KL_DIRECTIONS, f"{direction=} not in {KL_DIRECTIONS}"
    assert chunk_size >= 1, f"{chunk_size=} must be >= 1"
    vocab = policy_logits.shape[-1]
    policy_flat = policy_logits.reshape(-1, vocab)
    ref_flat = ref_logits.reshape(-1, vocab)
    rows = (mask.reshape(-1) != 0).nonzero().squeeze(1).to(policy_flat.device)
    grad = torch.is_grad_enabled() and (policy_logits.requires_grad or ref_logits.requires_grad)
    chunks = []
    for start in range(0, len(rows), chunk_size):
        part = rows[start : start + chunk_size]
        if grad:
            kl = torch.utils.checkpoint.checkpoint(
                _kl_rows, policy_flat, ref_flat, part, direction, use_reentrant=False
            )
        else:
            kl = _kl_rows(policy_flat, ref_flat, part, direction)
        chunks.append(kl)
    out = torch.zeros(policy_flat.shape[0], dtype=torch.float32, device=policy_flat.device)
    if chunks:
        out = out.index_put((rows,), torch.cat(chunks))
    return out.reshape(mask.shape)


def batch_kl(kl: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
    """Mean per-token KL over all trained tokens of a batch (0.0 when none)."""
    assert len(kl) == len(masks), f"{len(kl)=} != {len(masks)=}"
    count = sum(float(m.sum()) for m in masks)
    total = sum(float((k.float() * m).sum()) for k, m in zip(kl, masks, strict=True))
    return total / count if count else 0.0


def sequence_mean_kl(
    old_logprobs: Sequence[torch.Tensor],
    ref_logprobs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    config: KLConfig,
) -> float:
    """The KL the adaptive controller observes, as verl `apply_kl_penalty`: each sequence's token
    mean of kl(logp_old, logp_ref) (sum / (n + 1e-8)), averaged over the batch's sequences."""
    assert len(old_logprobs) == len(ref_logprobs) == len(masks), f"{len(masks)=}"
    if not masks:
        return 0.0
    per_seq = [
        float((config_kl(old, ref, config) * m).sum()) / (float(m.sum()) + 1e-8)
        for old, ref, m in zip(old_logprobs, ref_logprobs, masks, strict=True)
    ]
    return sum(per_seq) / len(per_seq)


def kl_reward_penalties(
    old_logprobs: Sequence[torch.Tensor],
    ref_logprobs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    config: KLConfig,
    coef: float,
) -> tuple[tuple[torch.Tensor, ...], float]:
    """KL in the reward: per-token penalties coef * kl(logp_old, logp_ref), and the batch KL.

    Subtract them from the token rewards (`advantages.outcome_token_rewards(groups, penalties)`);
    feed the batch KL to `AdaptiveKL.update` when the coefficient is adaptive.
    """
    assert coef >= 0.0, f"{coef=} must be >= 0"
    triples = zip(old_logprobs, ref_logprobs, masks, strict=True)
    kls = [config_kl(old, ref, config) * mask for old, ref, mask in triples]
    return tuple(coef * k for k in kls), batch_kl(kls, masks)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdaptiveKL:
    """KL coefficient of the reward: fixed (target = 0) or adaptive towards a target KL.

    The adaptive rule of Ziegler et al. (2019), as verl `AdaptiveKLController`:
    err = clamp(kl / target - 1, -0.2, 0.2); coef *= 1 + err * n_steps / horizon, where kl is
    `sequence_mean_kl` of the batch and n_steps its number of sequences (verl: the batch size).
    """

    coef: float
    target: float = 0.0
    horizon: int = 10000

    def __post_init__(self) -> None:
        assert self.coef >= 0.0, f"{self.coef=} must be >= 0"
        assert self.horizon >= 1, f"{self.horizon=} must be >= 1"

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> AdaptiveKL:
        kl = config.kl
        return cls(coef=kl.coef, target=kl.target, horizon=kl.horizon)

    def steer(self, config: AlgorithmConfig) -> AlgorithmConfig:
        """A step's config with this controller's coefficient (when it is adaptive)."""
        if self.target <= 0.0:
            return config
        return dataclasses.replace(config, kl=dataclasses.replace(config.kl, coef=self.coef))

    def state_dict(self) -> dict[str, float]:
        """The controller's state for a checkpoint (the current coefficient)."""
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> AdaptiveKL:
        """The controller with a checkpoint's coefficient (target and horizon from the config)."""
        coef = float(state["coef"])
        assert coef >= 0.0, f"checkpointed KL coefficient {coef=} must be >= 0"
        return dataclasses.replace(self, coef=coef)

    def update(self, current_kl: float, n_steps: int = 1) -> AdaptiveKL:
        """The next controller after observing `current_kl` over `n_steps` steps."""
        if self.target <= 0.0:
            return self
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        return dataclasses.replace(self, coef=self.coef * (1.0 + err * n_steps / self.horizon))
