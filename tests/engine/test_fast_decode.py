"""The engine's own decode step (`fast_decode`) against the HF forward: the same logprobs for
Llama (multi-head, grouped-query with a tied head) and Qwen2 (q/k/v biases) while rows join,
finish and move between slots; the weights it reads are the ones loaded now; a model it does
not implement takes the HF forward, and says so."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from rollouts.engine import kv
from tests.engine.batch_driver import greedy_through_batch, random_workload
from tests.gqa_models import llama_gqa, qwen2, random_model
from tests.hf_reference import teacher_forced_logprobs


def decode_all(model, tokenizer, prompts, lengths, decode: str, max_batch: int = 3):
    """Greedy outputs, logprobs and the decode path through `max_batch` slots."""
    return greedy_through_batch(
        model, tokenizer, prompts, lengths, max_batch=max_batch, decode=decode
    )


def prompts_and_lengths(seed: int, count: int = 7) -> tuple[list[list[int]], list[int]]:
    return random_workload(seed, count, max_new=24)


@pytest.fixture(scope="module")
def models(ref_model, tokenizer) -> dict[str, torch.nn.Module]:
    vocab = len(tokenizer)
    return {"llama": ref_model, "llama-gqa-tied": llama_gqa(vocab), "qwen2": qwen2(vocab)}


@pytest.mark.parametrize("name", ["llama", "llama-gqa-tied", "qwen2"])
def test_the_fast_step_gives_the_hf_forwards_tokens_and_logprobs(models, tokenizer, name):
    model = models[name]
    prompts, lengths = prompts_and_lengths(seed=len(name))
    fast_out, fast_lp, path = decode_all(model, tokenizer, prompts, lengths, "auto")
    hf_out, hf_lp, hf_path = decode_all(model, tokenizer, prompts, lengths, "hf")
    assert path == f"fast ({type(model).__name__})", path
    assert hf_path == "HF forward (--decode hf)", hf_path
    assert fast_out == hf_out
    for prompt, out, lp, ref in zip(prompts, fast_out, fast_lp, hf_lp, strict=True):
        assert len(out) == len(lp) == len(ref)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)
        # and both are the model's own full-sequence logprobs of those tokens
        forced = teacher_forced_logprobs(model, prompt, out)
        torch.testing.assert_close(torch.tensor(lp), forced, atol=1e-4, rtol=0)
    assert len({tuple(o) for o in fast_out}) > 1, "every prompt gave the same output"


@pytest.mark.parametrize(("block", "threads"), [(64, 1), (8, 1), (16, 2)])
def test_a_cache_in_blocks_gives_the_same_tokens_and_logprobs(
    models, tokenizer, monkeypatch, block, threads
):
    """The cache in blocks (an engine on one CPU thread), of 64 columns or of 8 and 16 so a
    step's attention spans several: read block by block, scores joined and values summed, as
    rows move and the timeline moves left and grows across blocks. The fast step and the HF
    forward (which reads the blocks joined) give the tokens of the cache in one block, and its
    logprobs to float32 rounding; the thread count at the step does not matter."""
    model = models["llama-gqa-tied"]
    prompts, lengths = prompts_and_lengths(seed=5, count=9)
    want_out, want_lp, _ = decode_all(model, tokenizer, prompts, lengths, "auto")
    monkeypatch.setattr(kv, "BLOCK_COLS", block)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for decode in ("auto", "hf"):
            batches: list = []
            out, lp, _ = greedy_through_batch(
                model,
                tokenizer,
                prompts,
                lengths,
                max_batch=3,
                decode=decode,
                cache_blocks=True,
                batches=batches,
            )
            assert batches[0]._kv.blocked and batches[0]._kv.block == block
            assert out == want_out, decode
            for got, want in zip(lp, want_lp, strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    finally:
        torch.set_num_threads(before)


def test_an_engine_starting_on_one_cpu_thread_keeps_its_cache_in_blocks() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kv.blocked_cache(torch.device("cpu"))
        torch.set_num_threads(2)
        assert not kv.blocked_cache(torch.device("cpu"))
        assert not kv.blocked_cache(torch.device("meta"))  # a GPU's: one block
    finally:
        torch.set_num_threads(before)


def test_the_fast_step_reads_the_weights_loaded_now(
    ref_model, tokenizer, other_model_dir: Path
) -> None:
    # a copy of a weight kept by the step (a fused projection, a cached head) would keep
    # serving the old model after a reload; the step must read the modules' weights each time
    model = copy.deepcopy(ref_model)
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    prompts, lengths = prompts_and_lengths(seed=5, count=4)
    before, _, _ = decode_all(model, tokenizer, prompts, lengths, "auto")
    with torch.no_grad():
        for name, tensor in other.state_dict().items():
            model.state_dict()[name].copy_(tensor)  # in place, as the server's reload does
    after, after_lp, _ = decode_all(model, tokenizer, prompts, lengths, "auto")
    want, want_lp, _ = decode_all(other, tokenizer, prompts, lengths, "hf")
    assert after == want and after != before
    for lp, ref in zip(after_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)


def test_a_model_the_step_does_not_implement_takes_the_hf_forward(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.hidden_act = "gelu"
    model = random_model(config)
    prompts, lengths = prompts_and_lengths(seed=3, count=4)
    out, lp, path = decode_all(model, tokenizer, prompts, lengths, "auto")
    assert path == "HF forward (hidden_act 'gelu' (this step implements silu))", path
    for prompt, o, p in zip(prompts, out, lp, strict=True):
        forced = teacher_forced_logprobs(model, prompt, o)
        torch.testing.assert_close(torch.tensor(p), forced, atol=1e-4, rtol=0)


def test_rollouts_serve_decode_hf_takes_the_hf_forward_and_says_so(tiny_model_dir) -> None:
    """`rollouts serve --decode hf`: the escape hatch, logged at start; default: the own step."""
    from rollouts.engine.launch import engine_spec, spawn, wait_healthy_sync

    procs = {
        flag: spawn(engine_spec(str(tiny_model_dir), max_batch=4, extra_args=flag))
        for flag in ((), ("--decode", "hf"))
    }
    try:
        for proc in procs.values():
            wait_healthy_sync(proc, 120.0)
        assert "decode steps: fast (LlamaForCausalLM)" in procs[()].log_tail()
        assert "decode steps: HF forward (--decode hf)" in procs[("--decode", "hf")].log_tail()
    finally:
        for proc in procs.values():
            proc.stop()
            proc.discard_log()
