"""Layout "prefix": sequences that begin alike run their shared tokens once, with the same loss,
gradients and logprobs as the "pad" layout (trainer/prefix_plan.py)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from rollouts.config import Config, ConfigError, load_config
from rollouts.trainer.batching import build_tensors, padding_fraction
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.prefix_plan import plan_shared_prefixes, shared_prefix_groups
from rollouts.types import ModelOutputs, PlainLoss, TrainBatch
from tests.gqa_models import qwen2
from tests.training.backend_helpers import (  # noqa: F401
    lora_config,
    nll_loss,
    one_torch_thread,
    tiny_config,
)


def grpo_batch(seed: int = 0, vocab: int = 200) -> TrainBatch:
    """Three prompts (lengths 11, 9, 14) of 4 samples each: untrained prompt, trained response,
    one response with an untrained span (a tool's output); samples of the second prompt begin
    their responses alike (the shared prefix runs past the prompt); then two sequences in no
    group, one of them with nothing trained."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for k, prompt_len in enumerate((11, 9, 14)):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
        opening = torch.randint(3, vocab, (3,), generator=g)
        for j in range(4):
            response = torch.randint(3, vocab, (3 + 2 * j + k,), generator=g)
            if k == 1:
                response = torch.cat([opening, response])
            seq = torch.cat([prompt, response])
            mask = torch.cat([torch.zeros(prompt_len), torch.ones(len(response))])
            if j == 3:
                mask[-3:-1] = 0.0
            ids.append(seq)
            masks.append(mask)
    for n, trained in ((10, True), (6, False)):
        ids.append(torch.randint(3, vocab, (n,), generator=g))
        masks.append(torch.cat([torch.zeros(2), torch.full((n - 2,), float(trained))]))
    return TrainBatch(
        input_ids=tuple(ids),
        loss_mask=tuple(masks),
        num_global_tokens=float(sum(m.sum() for m in masks)),
        num_global_seqs=float(len(ids)),
    )


def test_groups_are_the_prompts_and_each_prefix_is_their_common_tokens() -> None:
    batch = grpo_batch()
    groups = shared_prefix_groups(batch.input_ids, batch.loss_mask)
    assert [members for _, members in groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [p for p, _ in groups] == [11, 12, 14]  # prompt 2's responses share 3 tokens
    lengths = [int(x.shape[0]) for x in batch.input_ids]
    for budget in (40, 64, 1000):
        plans = plan_shared_prefixes(batch.input_ids, batch.loss_mask, budget)
        seen = sorted(i for p in plans for i in p.indices)
        assert seen == list(range(len(lengths)))  # every sequence once
        for plan in plans:
            assert plan.padded_tokens <= budget or plan.rows == 1
            mb = build_tensors(plan, batch.input_ids, 0, batch.loss_mask)
            assert (
                mb.targets.tolist()
                == torch.cat([batch.input_ids[i][1:] for i in plan.indices]).tolist()
            )
        assert 0.0 <= padding_fraction(plans, lengths) < 1.0
        computed = sum(p.computed_tokens(lengths) for p in plans)
        once = sum(lengths) - 3 * (11 + 12 + 14)  # each prefix once, not 4 times
        if budget == 40:  # groups split: a prefix runs once per micro-batch it has members in
            assert once < computed < sum(lengths)
        else:
            assert computed == once
    # a budget too small for a whole group: the group's prefix runs in each of its micro-batches
    small = plan_shared_prefixes(batch.input_ids, batch.loss_mask, 40)
    assert sum(len(p.prefix_lens) for p in small) > 3


def test_a_group_sharing_too_few_tokens_is_padded() -> None:
    ids = tuple(torch.tensor([1, 2, 3, 4, 5 + i, 6, 7]) for i in range(3))
    masks = tuple(torch.tensor([0, 0, 0, 0, 1, 1, 1.0]) for _ in ids)
    assert shared_prefix_groups(ids, masks) == []  # 4 tokens x 2 saved < 16
    plans = plan_shared_prefixes(ids, masks, 100)
    assert [p.prefix_lens for p in plans] == [()]


def _step(config: Config, batch: TrainBatch, entropy: bool = True):
    backend = create_pytorch_backend(config)
    seen: list[ModelOutputs] = []

    def loss_fn(outputs: ModelOutputs, b: TrainBatch):
        seen.append(outputs)
        loss, metrics = nll_loss(outputs, b)
        ent = sum((e.detach() * m).sum() for e, m in zip(outputs.entropy, b.loss_mask, strict=True))
        return loss, {**metrics, "entropy_sum": float(ent)}

    metrics = backend.forward_backward(batch, PlainLoss(fn=loss_fn), entropy=entropy).result()
    grads = {n: p.grad.clone() for n, p in backend.lm.named_parameters() if p.grad is not None}
    logprobs = backend.compute_logprobs(batch).result()
    backend.close()
    return metrics, grads, logprobs


def _with(config: Config, **training) -> Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **training))


def _assert_same_step(config: Config, batch: TrainBatch, budget: int, positions: str) -> None:
    pad = _step(
        _with(
            config,
            micro_batch_tokens=budget,
            logprob_positions=positions,
            micro_batch_layout="pad",
        ),
        batch,
    )
    pre = _step(
        _with(
            config,
            micro_batch_tokens=budget,
            logprob_positions=positions,
            micro_batch_layout="prefix",
        ),
        batch,
    )
    (m_pad, g_pad, lp_pad), (m_pre, g_pre, lp_pre) = pad, pre
    assert m_pre["loss"] == pytest.approx(m_pad["loss"], rel=1e-5) and m_pad["loss"] > 0
    assert m_pre["entropy_sum"] == pytest.approx(m_pad["entropy_sum"], rel=1e-5)
    assert m_pre["num_tokens"] == m_pad["num_tokens"]
    assert m_pre["computed_tokens"] < m_pad["computed_tokens"] == m_pad["num_tokens"]
    assert g_pre.keys() == g_pad.keys() and g_pad
    for name, grad in g_pad.items():
        torch.testing.assert_close(g_pre[name], grad, atol=1e-6, rtol=1e-4)
    for a, b in zip(lp_pad, lp_pre, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [40, 1000])
@pytest.mark.parametrize("positions", ["trained", "all"])
def test_the_prefix_layout_gives_the_pad_layouts_loss_gradients_and_logprobs(
    tiny_model_dir: Path, budget: int, positions: str
) -> None:
    _assert_same_step(tiny_config(tiny_model_dir), grpo_batch(seed=1), budget, positions)


def test_lora_adapters_get_the_same_gradients(tiny_model_dir: Path) -> None:
    _assert_same_step(lora_config(tiny_model_dir), grpo_batch(seed=2), 1000, "trained")


@pytest.fixture(scope="module")
def qwen2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with grouped-query attention and nonzero q/k/v biases, the tiny tokenizer."""
    out = tmp_path_factory.mktemp("qwen2-gqa")
    model = qwen2(vocab=260)
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_gqa_with_biases_gives_the_same_step(qwen2_dir: Path, attn: str) -> None:
    config = tiny_config(qwen2_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, attn_implementation=attn)
    )
    _assert_same_step(config, grpo_batch(seed=3), 64, "trained")


def test_a_sliding_window_model_is_refused_with_the_fix(qwen2_dir: Path, tmp_path: Path) -> None:
    config = Qwen2Config.from_pretrained(qwen2_dir)
    config.use_sliding_window = True
    config.sliding_window = 8
    config.max_window_layers = 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model_dir = tmp_path / "sliding"
    shutil.copytree(qwen2_dir, model_dir)
    config.save_pretrained(model_dir)
    with pytest.raises(ValueError, match="micro_batch_layout = 'pad'"):
        create_pytorch_backend(_with(tiny_config(model_dir), micro_batch_layout="prefix"))
    # left at "auto", the layout every model trains: "pad"
    backend = create_pytorch_backend(_with(tiny_config(model_dir), micro_batch_layout="auto"))
    assert backend.core.settings.layout == "pad"
    backend.close()


def test_the_config_refuses_prefix_with_fsdp_or_gradient_checkpointing(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[training]\nmicro_batch_layout = "prefix"\nbackend = "fsdp"\n')
    with pytest.raises(ConfigError, match="runs on one device"):
        load_config(path)
    path.write_text(
        '[training]\nmicro_batch_layout = "prefix"\n[model]\ngradient_checkpointing = true\n'
    )
    with pytest.raises(ConfigError, match="gradient_checkpointing = false"):
        load_config(path)


def test_critic_values_are_the_same(tiny_model_dir: Path) -> None:
    batch = grpo_batch(seed=4)
    values = {}
    for layout in ("pad", "prefix"):
        config = _with(tiny_config(tiny_model_dir), micro_batch_layout=layout)
        backend = create_pytorch_backend(config, value_head=True)
        head = backend.core.model.value_head
        with torch.no_grad():  # zero-initialised: give it weights that read the states
            head.weight.copy_(torch.linspace(-1.0, 1.0, head.weight.numel()).view_as(head.weight))
        values[layout] = backend.compute_values(batch).result()
        backend.close()
    for a, b in zip(values["pad"], values["prefix"], strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def sft_batch(seed: int = 4, vocab: int = 200) -> TrainBatch:
    """SFT's conversations: one system message (20 tokens), then each its own question
    (untrained) and answer (trained): no two share a prompt, all share the system message."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (20,), generator=g)
    ids, masks = [], []
    for k in range(5):
        question = torch.randint(3, vocab, (4 + k,), generator=g)
        answer = torch.randint(3, vocab, (6 + 2 * k,), generator=g)
        ids.append(torch.cat([system, question, answer]))
        masks.append(torch.cat([torch.zeros(20 + len(question)), torch.ones(len(answer))]))
    return TrainBatch(
        input_ids=tuple(ids),
        loss_mask=tuple(masks),
        num_global_tokens=float(sum(m.sum() for m in masks)),
        num_global_seqs=float(len(ids)),
    )


def test_conversations_of_their_own_prompts_share_their_system_message(
    tiny_model_dir: Path,
) -> None:
    batch = sft_batch()
    groups = shared_prefix_groups(batch.input_ids, batch.loss_mask)
    assert len(groups) == 1 and groups[0][1] == [0, 1, 2, 3, 4]
    assert groups[0][0] == 20  # the system message
    _assert_same_step(tiny_config(tiny_model_dir), batch, 1000, "trained")


def test_a_shared_prefix_trains_bit_equal_on_two_threads(tiny_model_dir: Path) -> None:
    """Every row of a group reads its prefix's keys and values, and the prefix's last state
    predicts each row's first response token: their gradients sum over the rows. torch's CPU
    `index_put_(accumulate=True)` (the backward of `x[idx]`, and of the cache's
    `batch_select_indices`) adds repeated rows with atomics across threads, in arrival order,
    so on two threads the same float32 step gave gradients an ulp apart from run to run (each
    of the two failed this alone). Same batch: the same gradients, bit for bit."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 200, (96,), generator=g)
    responses = [torch.randint(3, 200, (60 + k,), generator=g) for k in range(24)]
    ids = tuple(torch.cat([prompt, r]) for r in responses)
    masks = tuple(torch.cat([torch.zeros(96), torch.ones(len(x) - 96)]) for x in ids)
    batch = TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        num_global_tokens=float(sum(m.sum() for m in masks)),
        num_global_seqs=float(len(ids)),
    )
    config = _with(
        tiny_config(tiny_model_dir), micro_batch_tokens=4096, micro_batch_layout="prefix"
    )
    torch.set_num_threads(2)  # the module's fixture gives one; it puts its value back
    runs = [_step(config, batch)[1] for _ in range(3)]
    assert runs[0]
    for other in runs[1:]:
        differ = [n for n, grad in runs[0].items() if not torch.equal(other[n], grad)]
        assert not differ, f"gradients differ between identical steps: {differ}"
