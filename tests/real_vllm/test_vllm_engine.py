"""The project's vLLM client, weight sync and content check against the real vLLM (CPU build).

Every check compares what the engine serves with the trainer's own teacher-forced logprobs
(fp32: they agree to ~1e-5 when the weights are the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import trio

from rollouts.engine.launch import engine_server
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.pytorch import save_hf
from rollouts.types import TrainBatch
from rollouts.weights.check import (
    WeightContentError,
    check_engine,
    largest_gap,
    probe_ids,
    trainer_probe,
)
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.files import publish_weights
from rollouts.wire.generation import FinishReason, SamplingParams
from tests.real_vllm.conftest import VLLMServer
from tests.training.backend_helpers import tiny_config

SMOLLM2 = pytest.mark.smollm2  # on the "smollm2" server (conftest.py)
FP32_MATCH = 1e-4  # engine vs trainer logprobs on the same weights, fp32
# long enough to act on mid-way: ~5 s on SmolLM2 (one core, -O0). Not the tiny model: its
# batch-of-one decode steps are so short that the box stalls (timers of other processes too)
# until the request ends, so nothing can pause or abort it mid-way
LONG = SamplingParams(max_new_tokens=100, temperature=1.0, ignore_eos=True, seed=1)
# a request that is cut mid-way (abort, pause "abort", a sync): so long that no box finishes it
# before the cut lands (a fast one made LONG's 100 tokens within `_mid_way`); the cut ends it,
# so it costs no more time than LONG
CUT = SamplingParams(max_new_tokens=1500, temperature=1.0, ignore_eos=True, seed=1)


class Trainer:
    """A one-process backend on a model, its weights moved or written for the engine."""

    def __init__(self, model_dir: Path) -> None:
        self.backend = create_pytorch_backend(tiny_config(model_dir), total_steps=1)
        self.vocab = len(self.backend.tokenizer)

    def logprobs(self, prompt: list[int], output: tuple[int, ...]) -> list[float]:
        ids = torch.tensor([*prompt, *output])
        mask = torch.zeros(len(ids))
        mask[len(prompt) :] = 1.0
        batch = TrainBatch(input_ids=(ids,), loss_mask=(mask,), num_global_tokens=1.0)
        (lp,) = self.backend.compute_logprobs(batch).result()
        return lp[len(prompt) :].tolist()

    def scale(self, factor: float, only: str = "") -> None:
        """Weights whose name contains `only` times `factor` (a tied head moves with the
        embedding: it is the same parameter, so its own key is left out)."""
        weights = self.backend.get_weights()
        if self.backend.lm.config.tie_word_embeddings:
            del weights["lm_head.weight"]
        self.backend.load_weights({k: v * factor if only in k else v for k, v in weights.items()})

    def publish(self, root: Path, version: str) -> Path:
        return publish_weights(self.backend, root, version)


class Trainers(dict[str, Trainer]):
    """A trainer per model, built when a test first asks for it (a run of the tiny servers'
    tests never loads SmolLM2)."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        super().__init__()
        self.model_dirs = model_dirs

    def __missing__(self, name: str) -> Trainer:
        self[name] = Trainer(self.model_dirs[name])
        return self[name]


@pytest.fixture(scope="module")
def trainers(model_dirs: dict[str, Path]) -> Iterator[Trainers]:
    made = Trainers(model_dirs)
    yield made
    for trainer in made.values():
        trainer.backend.close()


async def _at_base(server: VLLMServer, trainer: Trainer, tmp: Path) -> VLLMEngine:
    """A client of `server`, the server reloaded with the trainer's weights as "base"."""
    engine = VLLMEngine(server.url)
    path = await trio.to_thread.run_sync(trainer.publish, tmp / "base", "base")
    await engine.update_weights_from_disk(str(path), "base")
    await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))  # warm
    return engine


def _prompt(trainer: Trainer, seed: int = 0) -> list[int]:
    return list(probe_ids(trainer.vocab, 12, seed))


@pytest.mark.parametrize("name", ["tiny", pytest.param("smollm2", marks=SMOLLM2)])
async def test_generate_logprobs_equal_the_trainers(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], name: str, tmp_path: Path
) -> None:
    trainer = trainers[name]
    engine = await _at_base(vllm[name], trainer, tmp_path)
    prompt = _prompt(trainer)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=7)
    done = await engine.generate(prompt, sampling)
    again = await engine.generate(prompt, sampling)  # the per-request seed is honoured
    probe = await trainer_probe(trainer.backend, prompt, "base", FP32_MATCH)
    gap = await check_engine(engine, probe)
    await engine.aclose()
    assert len(done.output_ids) == 24 and done.finish_reason == FinishReason.LENGTH
    assert again.output_ids == done.output_ids
    expected = trainer.logprobs(prompt, done.output_ids)
    assert largest_gap(expected, done.logprobs)[0] < FP32_MATCH
    assert gap < FP32_MATCH


def _teacher_forced(
    trainer: Trainer, prompt: list[int], output: tuple[int, ...], temperature: float
) -> list[float]:
    """The trainer model's logprob of each output token under softmax(logits / temperature)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = trainer.backend.lm(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[:-1]
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt) - 1 :].tolist()


async def test_sampled_logprobs_are_of_the_raw_logits_at_temperature_0_7(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], tmp_path: Path
) -> None:
    """`engines.served_logprobs = "auto"` takes vLLM's sampled-token logprobs as the raw
    logits' (its default `--logprobs-mode raw_logprobs`), which is what rollout correction
    compares with the trainer's: at temperature 0.7 they are log softmax(logits), not
    log softmax(logits / 0.7)."""
    trainer = trainers["tiny"]
    engine = await _at_base(vllm["tiny"], trainer, tmp_path)
    prompt = _prompt(trainer, seed=3)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.7, ignore_eos=True, seed=11)
    done = await engine.generate(prompt, sampling)
    await engine.aclose()
    raw = _teacher_forced(trainer, prompt, done.output_ids, 1.0)
    scaled = _teacher_forced(trainer, prompt, done.output_ids, 0.7)
    assert len(done.logprobs) == 24
    assert largest_gap(raw, done.logprobs)[0] < FP32_MATCH
    assert largest_gap(scaled, done.logprobs)[0] > 100 * FP32_MATCH  # the two are told apart


async def test_n_samples_on_the_completions_route(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer]
) -> None:
    prompt = _prompt(trainers["tiny"])
    body = {"prompt": prompt, "max_tokens": 6, "n": 3, "logprobs": 0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=vllm["tiny"].url, timeout=60) as client:
        answer = (await client.post("/v1/completions", json=body | {"seed": 3})).json()
    choices = answer["choices"]
    assert len(choices) == 3 and {c["index"] for c in choices} == {0, 1, 2}
    assert all(len(c["token_ids"]) == 6 for c in choices)
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # three samples, not one copied


async def _running(
    engine: VLLMEngine, prompt: list[int], rid: str, box: list, params: SamplingParams = LONG
) -> None:
    box.append(await engine.generate(prompt, params, rid=rid))


async def _mid_way() -> None:
    """Give a request just sent time to be mid-way (SmolLM2 makes ~20 tokens a second here;
    `_at_base` warmed the server after its reload)."""
    await trio.sleep(1.0)


@SMOLLM2
async def test_abort_by_request_id_returns_the_partial_output(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], tmp_path: Path
) -> None:
    engine = await _at_base(vllm["smollm2"], trainers["smollm2"], tmp_path)
    kept, aborted = [], []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            _running, engine, _prompt(trainers["smollm2"], 1), "grp-7-0", aborted, CUT
        )
        nursery.start_soon(_running, engine, _prompt(trainers["smollm2"], 2), "grp-8-0", kept)
        await _mid_way()
        await engine.abort("grp-7")
    await engine.aclose()
    assert aborted[0].finish_reason == FinishReason.ABORT
    assert 0 < len(aborted[0].output_ids) < CUT.max_new_tokens
    assert len(aborted[0].logprobs) == len(aborted[0].output_ids)
    assert kept[0].finish_reason == FinishReason.LENGTH  # another group's request ran on


@SMOLLM2
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_pause_with_a_request_running(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], mode: str, tmp_path: Path
) -> None:
    trainer = trainers["smollm2"]
    engine = await _at_base(vllm["smollm2"], trainer, tmp_path)
    box: list = []
    async with trio.open_nursery() as nursery:
        params = CUT if mode == "abort" else LONG
        nursery.start_soon(_running, engine, _prompt(trainer, 3), "pause-0", box, params)
        await _mid_way()
        await engine.pause(mode)
        paused_with = list(box)  # wait: done before the pause returns; abort: being answered
        await trio.sleep(0.5)
        frozen = list(box)
        await engine.resume()
    await engine.aclose()
    done = box[0]
    if mode == "abort":
        assert done.finish_reason == FinishReason.ABORT
        assert 0 < len(done.output_ids) < CUT.max_new_tokens
    elif mode == "wait":
        assert paused_with and done.finish_reason == FinishReason.LENGTH
    else:  # keep: frozen while paused, then finished on resume
        assert not frozen and done.finish_reason == FinishReason.LENGTH
    expected = trainer.logprobs(_prompt(trainer, 3), done.output_ids)
    assert largest_gap(expected, done.logprobs)[0] < FP32_MATCH


@pytest.mark.parametrize("name", ["tiny", "tied", pytest.param("smollm2", marks=SMOLLM2)])
async def test_disk_sync_serves_the_trainers_weights(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], name: str, tmp_path: Path
) -> None:
    """Every tensor moved (the tied embedding and head included): after the sync the engine's
    logprobs equal the trainer's, and it reports the version."""
    trainer = trainers[name]
    engine = await _at_base(vllm[name], trainer, tmp_path)
    trainer.scale(1.03)
    try:
        path = await trio.to_thread.run_sync(trainer.publish, tmp_path / "w", "1")
        probe = await trainer_probe(trainer.backend, _prompt(trainer), "1", FP32_MATCH)
        report = await sync_weights_to_engines([engine], path, "1", probe=probe)
        version = await engine.weight_version()
        out = await engine.generate(_prompt(trainer, 4), SamplingParams(max_new_tokens=8, seed=2))
    finally:
        trainer.scale(1 / 1.03)
    await engine.aclose()
    assert report.ok and version == "1"
    assert report.results[0].content_gap < FP32_MATCH
    assert out.weight_version == "1"


@pytest.mark.parametrize("name", ["tied", pytest.param("smollm2", marks=SMOLLM2)])
async def test_content_check_catches_a_stale_tied_head(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], name: str, tmp_path: Path
) -> None:
    """Files written as `save_pretrained` does by default (no `lm_head.weight` for a tied head):
    vLLM reloads the embedding, keeps the old head and reports the new version. The label
    check passes; the content check does not."""
    trainer = trainers[name]
    engine = await _at_base(vllm[name], trainer, tmp_path)
    trainer.scale(1.05, only="embed")
    try:
        lm = trainer.backend.lm
        await trio.to_thread.run_sync(save_hf, lm, None, tmp_path / "hf", None)
        probe = await trainer_probe(trainer.backend, _prompt(trainer), "1", FP32_MATCH)
    finally:
        trainer.scale(1 / 1.05, only="embed")
    await engine.update_weights_from_disk(str(tmp_path / "hf"), "1")
    assert await engine.weight_version() == "1"
    with pytest.raises(WeightContentError, match="does not serve the trainer's weights"):
        await check_engine(engine, probe, step=1)
    await engine.aclose()


@SMOLLM2
async def test_partial_rollout_aborted_by_a_sync_continues_on_the_new_weights(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer], tmp_path: Path
) -> None:
    trainer = trainers["smollm2"]
    engine = await _at_base(vllm["smollm2"], trainer, tmp_path)
    prompt = _prompt(trainer, 5)
    box: list = []
    trainer.scale(1.02)
    try:
        path = await trio.to_thread.run_sync(trainer.publish, tmp_path / "w", "1")
        probe = await trainer_probe(trainer.backend, prompt, "1", FP32_MATCH)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_running, engine, prompt, "part-0", box, CUT)
            await _mid_way()
            report = await sync_weights_to_engines([engine], path, "1", probe=probe)
        partial = box[0]
        rest = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=5)
        continued = await engine.generate([*prompt, *partial.output_ids], rest)
        expected = trainer.logprobs([*prompt, *partial.output_ids], continued.output_ids)
    finally:
        trainer.scale(1 / 1.02)
    await engine.aclose()
    assert report.ok
    assert partial.finish_reason == FinishReason.ABORT and partial.weight_version == "base"
    assert 0 < len(partial.output_ids) < CUT.max_new_tokens
    assert continued.weight_version == "1" and len(continued.output_ids) == 16
    assert largest_gap(expected, continued.logprobs)[0] < FP32_MATCH


async def test_builtin_engine_matches_vllm(
    vllm: dict[str, VLLMServer],
    trainers: dict[str, Trainer],
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Same model, same token ids: greedy tokens equal, logprobs within 1e-4."""
    trainer = trainers["tiny"]
    real = await _at_base(vllm["tiny"], trainer, tmp_path)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    async with engine_server(model_dirs["tiny"]) as url:
        builtin = SGLangEngine(url)
        for seed in range(3):
            prompt = _prompt(trainer, 10 + seed)
            a, b = await real.generate(prompt, greedy), await builtin.generate(prompt, greedy)
            assert a.output_ids == b.output_ids
            assert largest_gap(a.logprobs, b.logprobs)[0] < FP32_MATCH
            ids = probe_ids(trainer.vocab, 32, seed)
            pa, pb = await real.prompt_logprobs(ids), await builtin.prompt_logprobs(ids)
            assert largest_gap(pa, pb)[0] < FP32_MATCH
        await builtin.aclose()
    await real.aclose()


async def test_an_rl_batch_of_seeded_requests_survives(
    vllm: dict[str, VLLMServer], trainers: dict[str, Trainer]
) -> None:
    """An RL batch at once: 16 prompts x 8 seeded samples (a group shares its prompt), 64 new
    tokens each. With chunked prefill on (vLLM's default) this kills vLLM 0.32's CPU engine
    within a round ("CPU Generator does not use offset": a seeded request whose sampled token
    is discarded); scripts/serve_vllm.sh turns it off."""
    engine = VLLMEngine(vllm["tiny2"].url)  # vLLM's default optimization level
    vocab = trainers["tiny"].vocab
    done: list = []

    async def one(group: int, i: int) -> None:
        prompt = list(probe_ids(vocab, 16 + 2 * group, seed=100 + group))
        sampling = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True, seed=i)
        done.append(await engine.generate(prompt, sampling, rid=f"burst-{group}-{i}"))

    for _ in range(2):
        async with trio.open_nursery() as nursery:
            for group in range(16):
                for i in range(8):
                    nursery.start_soon(one, group, i)
    await engine.aclose()
    assert len(done) == 256 and all(len(c.output_ids) == 64 for c in done)
