"""The floor of an RL step: the same work done in one process with plain HF + torch.

Generation is one left-padded `model.generate` call (`num_return_sequences = n`, sampling, no
KV-cache tricks beyond HF's own); training is one plain torch forward/backward over the
prompt+completion sequences (micro-batched by the same token budget as the project's backend),
a GRPO-style policy-gradient loss, gradient clipping and one AdamW step. Rewards are random 0/1
per sample (scoring is not what is measured); advantages are group-normalised like GRPO's.
Used by `bench_rl_step.py` as the baseline the project's sync and async steps are compared to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FloorStep:
    """Seconds of one floor step and what it produced."""

    generate_s: float
    train_s: float
    samples: int
    generated_tokens: int

    @property
    def step_s(self) -> float:
        return self.generate_s + self.train_s


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FloorSpec:
    """The workload: prompts (token ids), samples per prompt, sampling and optimizer settings."""

    prompts: tuple[tuple[int, ...], ...]
    n_samples: int
    max_new_tokens: int
    temperature: float
    lr: float
    max_grad_norm: float
    micro_batch_tokens: int


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def generate(model, spec: FloorSpec, pad_id: int, eos_id: int) -> list[tuple[int, ...]]:
    """Completions (up to and including EOS) of every prompt, `n_samples` each, prompt-major."""
    ids, mask = _left_padded(spec.prompts, pad_id)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=spec.temperature > 0,
            temperature=spec.temperature if spec.temperature > 0 else None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=spec.max_new_tokens,
            num_return_sequences=spec.n_samples,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )
    completions = []
    for row in out[:, ids.shape[1] :].tolist():
        end = row.index(eos_id) + 1 if eos_id in row else len(row)
        completions.append(tuple(row[:end]))
    assert len(completions) == len(spec.prompts) * spec.n_samples, f"{len(completions)=}"
    return completions


def grpo_advantages(n_groups: int, n_samples: int, seed: int) -> torch.Tensor:
    """Random 0/1 rewards normalised within each group (mean 0, std 1 where the group varies)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n_groups, n_samples), generator=g).float()
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    return adv.flatten()


def _micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive rows whose padded size (rows x longest) stays within `budget` tokens."""
    out: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lengths):
        if out[-1] and max(longest, n) * (len(out[-1]) + 1) > budget:
            out.append([])
            longest = 0
        out[-1].append(i)
        longest = max(longest, n)
    return out


def train_step(model, optimizer, spec, completions, advantages, pad_id: int) -> None:
    """One policy-gradient step over prompt+completion rows (token-mean over completions)."""
    n = spec.n_samples
    rows = [tuple(spec.prompts[i // n]) + c for i, c in enumerate(completions)]
    starts = [len(spec.prompts[i // n]) for i in range(len(rows))]
    total = float(sum(len(c) for c in completions))
    model.train()
    for idx in _micro_batches([len(r) for r in rows], spec.micro_batch_tokens):
        width = max(len(rows[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width - 1))
        for j, i in enumerate(idx):
            ids[j, : len(rows[i])] = torch.tensor(rows[i])
            attn[j, : len(rows[i])] = 1
            mask[j, starts[i] - 1 : len(rows[i]) - 1] = 1.0  # positions predicting completions
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
        logits = logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        adv = advantages[idx][:, None]
        ratio = torch.exp(logp - logp.detach())  # = 1; the gradient of PPO's on-policy ratio
        loss = -(ratio * adv * mask).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _layer_forwards(model, compile_train: bool) -> tuple[list, list]:
    """(eager, training) forwards of the decoder layers: the training ones torch.compile'd like
    the project's `model.compile` (generation always runs eager, as HF's `generate` does)."""
    layers = model.get_decoder().layers
    eager = [layer.forward for layer in layers]
    if not compile_train:
        return eager, eager
    return eager, [torch.compile(f, dynamic=True) for f in eager]


def _use(model, forwards: list) -> None:
    for layer, forward in zip(model.get_decoder().layers, forwards, strict=True):
        layer.forward = forward


def run_floor(
    model_dir: Path, spec: FloorSpec, steps: int, seed: int = 0, compile_train: bool = False
) -> list[FloorStep]:
    """`steps` floor steps (generate, then train) on the model in `model_dir`; with
    `compile_train` the training forward/backward runs compiled decoder layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eager, train_forwards = _layer_forwards(model, compile_train)
    eos_id = int(tokenizer.eos_token_id)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    torch.manual_seed(seed)
    out: list[FloorStep] = []
    for step in range(steps):
        t0 = time.perf_counter()
        model.eval()
        _use(model, eager)
        completions = generate(model, spec, pad_id, eos_id)
        t1 = time.perf_counter()
        adv = grpo_advantages(len(spec.prompts), spec.n_samples, seed + step)
        _use(model, train_forwards)
        train_step(model, optimizer, spec, completions, adv, pad_id)
        t2 = time.perf_counter()
        tokens = sum(len(c) for c in completions)
        out.append(
            FloorStep(
                generate_s=t1 - t0,
                train_s=t2 - t1,
                samples=len(completions),
                generated_tokens=tokens,
            )
        )
    return out
