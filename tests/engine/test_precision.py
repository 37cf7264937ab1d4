"""`--autocast bfloat16` (`engines.builtin.autocast`): the engine computes what a trainer under
bf16 autocast computes (fp32 weights, bf16 matmuls), on every decode path and after a weight
reload, where a bf16 engine computes another function; a tied LM head follows the embedding
(`engine/precision.py`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollouts.config import ConfigError, config_from_dict
from rollouts.engine import precision
from rollouts.engine.launch import engine_server
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.weights.check import probe_dtype
from tests.engine.batch_driver import greedy_through_batch, random_workload
from tests.gqa_models import llama_gqa, qwen2
from tests.hf_reference import teacher_forced_logprobs

BF16 = torch.bfloat16


def autocast_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's logprobs: the fp32 model's forward under bf16 autocast."""
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return teacher_forced_logprobs(model, prompt, output)


def mixed(model: torch.nn.Module) -> torch.nn.Module:
    out = copy.deepcopy(model)
    precision.mix(out, "bfloat16")
    return out


def largest_gap(model, engine_model, decode: str, seed: int) -> tuple[float, list[list[int]]]:
    """The largest |engine - trainer autocast| logprob over a workload's greedy tokens."""
    prompts, lengths = random_workload(seed, 6, max_new=16)
    outs, lps, _ = greedy_through_batch(
        engine_model, None, prompts, lengths, max_batch=3, decode=decode
    )
    gap = 0.0
    for prompt, out, lp in zip(prompts, outs, lps, strict=True):
        want = autocast_logprobs(model, prompt, out)
        gap = max(gap, float((torch.tensor(lp) - want).abs().max()))
    return gap, outs


@pytest.fixture(scope="module")
def models(tokenizer) -> dict[str, torch.nn.Module]:
    """The trainer's models, with eager attention: the function the engine's own decode step
    computes (under bf16, SDPA's CPU kernel rounds differently; the engine then takes the
    trainer's `model.attn_implementation` for its HF forward)."""
    vocab = len(tokenizer)
    out = {"llama-gqa-tied": llama_gqa(vocab), "qwen2": qwen2(vocab)}
    for model in out.values():
        model.set_attn_implementation("eager")
    return out


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2"])
@pytest.mark.parametrize("decode", ["auto", "hf"])
def test_the_mixed_engine_serves_the_trainers_autocast_logprobs(models, name, decode) -> None:
    model = models[name]
    engine = mixed(model)
    linear = engine.model.layers[0].mlp.up_proj
    assert linear.weight.dtype == BF16 and engine.model.norm.weight.dtype == torch.float32
    assert engine.lm_head.weight.dtype == BF16
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    gap, outs = largest_gap(model, engine, decode, seed=11)
    bf16_gap, _ = largest_gap(model, copy.deepcopy(model).to(BF16), decode, seed=11)
    assert gap < 1e-4, gap  # the same function, rows joining and leaving the batch
    assert bf16_gap > 0.05, bf16_gap  # a bf16 engine computes another one
    assert len({tuple(o) for o in outs}) > 1, "every prompt gave the same output"


def test_a_tied_head_follows_the_embedding_after_a_reload(models) -> None:
    model = models["llama-gqa-tied"]
    engine = mixed(model)
    assert engine.lm_head.weight is not engine.model.embed_tokens.weight  # a bf16 copy
    with torch.no_grad():  # a reload writes the embedding in place (a tied checkpoint has no
        engine.model.embed_tokens.weight.mul_(1.5)  # lm_head.weight of its own)
    stale = engine.lm_head.weight.clone()
    precision.refresh(engine)
    assert not torch.equal(stale, engine.lm_head.weight)
    want = engine.model.embed_tokens.weight.to(BF16)
    assert torch.equal(engine.lm_head.weight, want)


def test_the_config_asks_for_fp32_weights_under_autocast() -> None:
    on = {"engines": {"builtin": {"autocast": "bfloat16"}}}
    assert probe_dtype(config_from_dict(on)) == "bfloat16"  # the check's bf16 tolerance
    bad = {"engines": {"builtin": {"autocast": "bfloat16", "dtype": "bfloat16"}}}
    with pytest.raises(ConfigError, match=r'engines.builtin.dtype = "float32"'):
        config_from_dict(bad)


def tied_model(root: Path, seed: int) -> Path:
    spec = TinyModelSpec(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        seed=seed,
        tie_embeddings=True,
    )
    return make_tiny_model(root / f"tied-{seed}", spec)


async def test_a_server_under_autocast_serves_the_trainers_numbers_and_reloads(
    tmp_path: Path,
) -> None:
    first, second = tied_model(tmp_path, 0), tied_model(tmp_path, 1)
    assert "lm_head.weight" not in _saved_names(second)  # the reload must fill the head itself
    prompt = [5, 9, 2, 7, 11, 3, 8, 14, 4]
    async with engine_server(first, autocast="bfloat16", attn_implementation="eager") as url:
        engine = VLLMEngine(url)
        try:
            for path in (first, second):
                if path != first:
                    await engine.update_weights_from_disk(str(path), "v1")
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, attn_implementation="eager"
                ).eval()
                want = autocast_logprobs(model, prompt[:1], prompt[1:])
                served = torch.tensor(await engine.prompt_logprobs(prompt))
                assert float((served - want).abs().max()) < 1e-4, (path.name, served, want)
        finally:
            await engine.aclose()


def _saved_names(path: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            names |= set(handle.keys())
    return names


def _device_logprobs(model, prompt: list[int], output: list[int], autocast: bool) -> torch.Tensor:
    device = next(model.parameters()).device
    full = torch.tensor([prompt + output], device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=BF16, enabled=autocast):
        logits = model(full).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(output, device=device)[:, None]
    return logits.log_softmax(-1).gather(1, target)[:, 0].cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_captured_mixed_step_serves_the_trainers_logprobs(models) -> None:
    # the engine's default path on a GPU: the fast step replayed as CUDA graphs, under autocast
    model = copy.deepcopy(models["llama-gqa-tied"]).cuda()
    gaps = {}
    for name, engine in (("mixed", mixed(model)), ("bf16", copy.deepcopy(model).to(BF16))):
        prompts, lengths = random_workload(7, 6, max_new=16)
        outs, lps, path = greedy_through_batch(
            engine, None, prompts, lengths, max_batch=3, decode="auto"
        )
        assert "graphs" in path, path
        gaps[name] = max(
            float((torch.tensor(lp) - _device_logprobs(model, p, o, autocast=True)).abs().max())
            for p, o, lp in zip(prompts, outs, lps, strict=True)
        )
    print(f"largest |engine - trainer autocast| on the GPU: {gaps}")
    assert gaps["mixed"] < 0.02, gaps
    assert gaps["bf16"] > 2 * gaps["mixed"], gaps
