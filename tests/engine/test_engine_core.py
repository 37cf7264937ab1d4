"""The engine core in-process (its worker thread, no HTTP): exact outputs while rows join,
finish and move between slots and the KV cache shifts and grows; one prefill per distinct
prompt; seeded sampling that does not depend on the batch; running rows prefilled again on
weights reloaded under them."""

from __future__ import annotations

import random
import threading
import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollouts.engine import kv as kvops
from rollouts.engine.core import CoreOptions, EngineCore, Sequence
from rollouts.engine.dist_weights import DistWeights
from rollouts.engine.sampling import SamplingSpec
from rollouts.engine.scheduler import GATHER_GAP_S, GATHER_MAX_S, keep_gathering
from rollouts.wire.generation import FinishReason
from tests.hf_reference import teacher_forced_logprobs

WAIT_S = 120.0


def run_core(model, tokenizer, seqs: list[Sequence], **options) -> list[Sequence]:
    """Submit `seqs` (in batches of 3, as requests would arrive), run the worker until every
    one has finished, then stop it."""
    core = EngineCore(model, tokenizer, CoreOptions(eos_token_ids=(), **options), "v1")
    done = threading.Semaphore(0)
    for seq in seqs:
        seq.notify = lambda _s: done.release()
    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        for i in range(0, len(seqs), 3):
            assert core.submit(seqs[i : i + 3]), "queue full"
        for _ in seqs:
            assert done.acquire(timeout=WAIT_S), "a sequence never finished"
    finally:
        core.stop()
        worker.join(WAIT_S)
    assert core.idle(), f"{core.load()=}"
    return seqs


@torch.no_grad()
def greedy_no_eos(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """Greedy continuation by full forwards without a cache, EOS not special."""
    out: list[int] = []
    for _ in range(max_new):
        out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def make_seq(i: int, prompt: list[int], max_new: int, spec: SamplingSpec, seed=None) -> Sequence:
    return Sequence(
        rid=f"r{i}", prompt_ids=prompt, spec=spec, max_new=max_new, notify=print, seed=seed
    )


def test_greedy_exact_through_joins_moves_and_cache_growth(
    ref_model, tokenizer, monkeypatch
) -> None:
    monkeypatch.setattr(kvops, "GROW_COLS", 8)  # start small: the cache must shift and grow
    prefilled: list[int] = []
    real_prefill = kvops.prefill

    def counting_prefill(model, prompts, pad_id, shared=None):
        prefilled.append(len(prompts))
        return real_prefill(model, prompts, pad_id, shared)

    monkeypatch.setattr(kvops, "prefill", counting_prefill)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(7)]
    prompts = [prompts[0]] * 3 + prompts[1:]  # submitted together: one prefill for the three
    greedy = SamplingSpec(temperature=0.0, ignore_eos=True)
    lengths = [rng.randint(1, 24) for _ in prompts]
    seqs = [
        make_seq(i, p, n, greedy) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    run_core(ref_model, tokenizer, seqs, max_batch=4, max_prefill=4)
    for seq, prompt, n in zip(seqs, prompts, lengths, strict=True):
        assert seq.stop is not None and seq.stop.reason is FinishReason.LENGTH, seq.rid
        assert seq.output_ids == greedy_no_eos(ref_model, prompt, n), seq.rid
        expected = teacher_forced_logprobs(ref_model, prompt, seq.output_ids)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)
        assert seq.weight_version == "v1"
    assert sum(prefilled) == len(prompts) - 2, f"{prefilled=}"


def test_n_copies_of_one_prompt_are_prefilled_once(ref_model, tokenizer, monkeypatch) -> None:
    prefilled: list[int] = []
    real_prefill = kvops.prefill
    monkeypatch.setattr(
        kvops,
        "prefill",
        lambda m, p, pad, shared=None: prefilled.append(len(p)) or real_prefill(m, p, pad, shared),
    )
    spec = SamplingSpec(temperature=1.0, ignore_eos=True)
    core = EngineCore(ref_model, tokenizer, CoreOptions(max_batch=8), "v1")
    finished = threading.Semaphore(0)
    seqs = [make_seq(i, [5, 6, 7], 4, spec) for i in range(8)]
    for seq in seqs:
        seq.notify = lambda _s: finished.release()
    assert core.submit(seqs)
    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        for _ in seqs:
            assert finished.acquire(timeout=WAIT_S), "a sequence never finished"
    finally:
        core.stop()
        worker.join(WAIT_S)
    assert prefilled == [1], f"{prefilled=}"
    assert all(len(s.output_ids) == 4 and len(s.logprobs) == 4 for s in seqs)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_seeded_sampling_does_not_depend_on_the_batch(ref_model, tokenizer, top_p) -> None:
    spec = SamplingSpec(temperature=1.0, top_p=top_p, ignore_eos=True)
    prompt = [10, 20, 30, 40]
    alone = run_core(ref_model, tokenizer, [make_seq(0, prompt, 12, spec, seed=5)], max_batch=8)
    others = [make_seq(i, [i + 3] * (i + 1), 6 + i, spec) for i in range(1, 6)]
    greedy = make_seq(9, prompt, 12, SamplingSpec(temperature=0.0, ignore_eos=True))
    crowd = run_core(
        ref_model,
        tokenizer,
        [*others[:2], make_seq(0, prompt, 12, spec, seed=5), greedy, *others[2:]],
        max_batch=8,
    )
    assert crowd[2].output_ids == alone[0].output_ids
    assert greedy.output_ids == greedy_no_eos(ref_model, prompt, 12)  # greedy among sampled
    expected = teacher_forced_logprobs(ref_model, prompt, alone[0].output_ids)
    torch.testing.assert_close(torch.tensor(alone[0].logprobs), expected, atol=1e-4, rtol=0)


def test_a_fresh_batch_gathers_a_burst_but_not_for_long() -> None:
    def gather(waiting: int, since_last_s: float, gathered_s: float) -> bool:
        return keep_gathering(
            waiting=waiting, max_batch=8, since_last_s=since_last_s, gathered_s=gathered_s
        )

    assert gather(3, 0.0, 0.0)  # requests still arriving
    assert not gather(8, 0.0, 0.0)  # a full batch is waiting
    assert not gather(3, GATHER_GAP_S, 0.0)  # the burst is over
    assert not gather(3, 0.0, GATHER_MAX_S)  # waited long enough


def test_a_failed_step_fails_the_running_rows_and_the_core_goes_on(
    ref_model, tokenizer, monkeypatch
) -> None:
    real_decode = kvops.decode
    calls = []

    def decode_failing_once(model, kv, tokens_B, step=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected decode fault")
        return real_decode(model, kv, tokens_B, step)

    monkeypatch.setattr(kvops, "decode", decode_failing_once)
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    core = EngineCore(ref_model, tokenizer, CoreOptions(max_batch=4), "v1")
    done = threading.Semaphore(0)
    first, second = (make_seq(i, [4, 5, 6], 5, spec) for i in range(2))
    for seq in (first, second):
        seq.notify = lambda _s: done.release()
    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        assert core.submit([first]) and done.acquire(timeout=WAIT_S), "no answer"
        assert core.submit([second]) and done.acquire(timeout=WAIT_S), "no answer"
    finally:
        core.stop()
        worker.join(WAIT_S)
    assert first.stop.reason is FinishReason.ERROR
    assert len(first.output_ids) == len(first.logprobs) == 2  # prefill + one step
    assert second.stop.reason is FinishReason.LENGTH
    assert second.output_ids == greedy_no_eos(ref_model, [4, 5, 6], 5)


def test_aborting_one_running_row_keeps_the_others_exact(ref_model, tokenizer) -> None:
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    prompts = [[7, 8, 9], [3, 4], [11, 12, 13, 14]]
    seqs = [make_seq(i, p, 60, spec) for i, p in enumerate(prompts)]
    core = EngineCore(ref_model, tokenizer, CoreOptions(max_batch=4), "v1")
    done = threading.Semaphore(0)
    for seq in seqs:
        seq.notify = lambda _s: done.release()
    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        assert core.submit(seqs)
        deadline = time.monotonic() + WAIT_S
        while core.load()[0] < 3:  # all three decoding (60 steps leave time to catch them)
            assert time.monotonic() < deadline, f"{core.load()=}"
            time.sleep(0.001)
        core.post(lambda: core.abort("r0"))  # runs between two steps
        for _ in seqs:
            assert done.acquire(timeout=WAIT_S), "a sequence never finished"
    finally:
        core.stop()
        worker.join(WAIT_S)
    assert seqs[0].stop.reason is FinishReason.ABORT
    assert len(seqs[0].output_ids) == len(seqs[0].logprobs) < 60
    for seq, prompt in zip(seqs[1:], prompts[1:], strict=True):
        assert seq.stop.reason is FinishReason.LENGTH
        assert seq.output_ids == greedy_no_eos(ref_model, prompt, 60)


def test_grouped_query_attention_model_is_exact() -> None:
    """A Qwen2-shaped model (2 KV heads for 4 query heads) through the slot cache."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    seqs = [make_seq(i, p, 3 + 4 * i, spec) for i, p in enumerate(prompts)]
    run_core(model, None, seqs, max_batch=2)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == greedy_no_eos(model, prompt, seq.max_new), seq.rid
        expected = teacher_forced_logprobs(model, prompt, seq.output_ids)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)


def test_stop_strings_see_the_text_built_incrementally(ref_model, tokenizer) -> None:
    prompt = [40, 41, 42, 43]

    def spec(stop: str) -> SamplingSpec:
        return SamplingSpec(temperature=1.0, ignore_eos=True, stop=(stop,))

    free = run_core(ref_model, tokenizer, [make_seq(0, prompt, 40, spec("\x00no"), seed=3)])[0]
    full = tokenizer.decode(free.output_ids, skip_special_tokens=False)
    assert free.text == full or (full.endswith("\ufffd") and full.startswith(free.text))
    at = next(
        i
        for i in range(3, len(full) - 1)
        if full[i : i + 2].isascii()
        and full[i : i + 2].isprintable()
        and full.find(full[i : i + 2]) == i
    )
    stop = full[at : at + 2]
    cut = run_core(ref_model, tokenizer, [make_seq(0, prompt, 40, spec(stop), seed=3)])[0]
    assert (cut.stop.reason, cut.stop.matched) == (FinishReason.STOP, stop)
    text = tokenizer.decode(cut.output_ids, skip_special_tokens=False)
    assert text.endswith(stop) and full.startswith(text), (text, stop)


@pytest.mark.parametrize("route", ["disk", "distributed"])
def test_a_reload_in_a_keep_pause_prefills_the_running_rows_again(
    tiny_model_dir, other_model_dir, ref_model, tokenizer, route
) -> None:
    """Rows of unequal prompts and output counts (one prompt twice), prefilled again two per
    forward after the weights change under them (from disk, or a received bucket as
    `/update_weights_from_distributed` loads it): each row's tokens before the reload are the
    old model's greedy ones, those after it the new model's given every token before them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new_model = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    prompts = [[7, 8, 9], [3, 4], [11, 12, 13, 14, 15, 16], [7, 8, 9]]
    seqs = [make_seq(i, p, 60, spec) for i, p in enumerate(prompts)]
    core = EngineCore(model, tokenizer, CoreOptions(max_batch=4, max_prefill=2), "v1")
    done = threading.Semaphore(0)
    for seq in seqs:
        seq.notify = lambda _s: done.release()
    replies: list[object] = []
    bucket = list(new_model.state_dict().items())
    state = types.SimpleNamespace(core=core, sglang_pause="retract")  # what the loader reads
    load_bucket = DistWeights(state)._loader(bucket, "v2", flush_cache=True)  # type: ignore[arg-type]

    def reload_in_keep_pause() -> None:
        core.paused = True
        if route == "disk":
            core.reload(str(other_model_dir), "v2")
        else:
            load_bucket(replies.append)
        core.paused = False

    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        assert core.submit(seqs)
        deadline = time.monotonic() + WAIT_S
        while core.load()[0] < len(seqs):  # admitted two per step: unequal output counts
            assert time.monotonic() < deadline, f"{core.load()=}"
            time.sleep(0.001)
        core.post(reload_in_keep_pause)  # runs between two steps
        for _ in seqs:
            assert done.acquire(timeout=WAIT_S), "a sequence never finished"
    finally:
        core.stop()
        worker.join(WAIT_S)
    assert replies == ([] if route == "disk" else [None]), f"{replies=}"
    for seq, prompt in zip(seqs, prompts, strict=True):
        spans = seq.version_spans()
        assert [s["version"] for s in spans] == ["v1", "v2"], f"{seq.rid}: {spans}"
        cut, out = spans[1]["start"], seq.output_ids
        assert 1 <= cut < len(out) == 60, f"{seq.rid}: {cut=} {len(out)=}"
        assert out[:cut] == greedy_no_eos(ref_model, prompt, cut), seq.rid
        assert out[cut:] == greedy_no_eos(new_model, prompt + out[:cut], 60 - cut), seq.rid
        old_lp = teacher_forced_logprobs(ref_model, prompt, out)[:cut]
        new_lp = teacher_forced_logprobs(new_model, prompt, out)[cut:]
        served = torch.tensor(seq.logprobs)
        torch.testing.assert_close(served[:cut], old_lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(served[cut:], new_lp, atol=1e-4, rtol=0)


def test_decode_attention_mask_views_start_on_an_aligned_column(
    ref_model, tokenizer, monkeypatch
) -> None:
    # CUDA's memory-efficient attention read a mask view starting at an odd column from a
    # misaligned address (the first H100 run): every decode mask must start on ALIGN_COLS
    monkeypatch.setattr(kvops, "GROW_COLS", 8)
    starts: list[tuple[int, int]] = []  # (mask view's offset in its row, the rows' lo)
    real_decode = kvops.decode

    def watching_decode(model, kv, tokens_B, step=None):
        b, t = kv.batch, kv.t
        view = kv.mask_R_C[:b, None, None, kv.first_col() : t + 1]
        starts.append((view.storage_offset() % kv.mask_R_C.stride(0), kv.lo))
        return real_decode(model, kv, tokens_B, step)

    monkeypatch.setattr(kvops, "decode", watching_decode)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    greedy = SamplingSpec(temperature=0.0, ignore_eos=True)
    lengths = [rng.randint(1, 20) for _ in prompts]
    pairs = enumerate(zip(prompts, lengths, strict=True))
    seqs = [make_seq(i, p, n, greedy) for i, (p, n) in pairs]
    run_core(ref_model, tokenizer, seqs, max_batch=3, max_prefill=3)
    assert starts and all(offset % kvops.ALIGN_COLS == 0 for offset, _ in starts), starts
    assert any(lo % kvops.ALIGN_COLS for _, lo in starts), "no step had an unaligned lo"
    for seq, prompt, n in zip(seqs, prompts, lengths, strict=True):
        assert seq.output_ids == greedy_no_eos(ref_model, prompt, n), seq.rid


def test_a_sleep_frees_the_idle_kv_cache(ref_model, tokenizer) -> None:
    # the first H100 run: asleep, the engine still held its 1.5 GiB KV cache (kept at its size
    # once the batch drained), while the sleep said "kv_cache" was released
    core = EngineCore(ref_model, tokenizer, CoreOptions(eos_token_ids=(), max_batch=4), "v1")
    greedy = SamplingSpec(temperature=0.0, ignore_eos=True)
    done = threading.Semaphore(0)
    seqs = [make_seq(i, [5, 6, 7 + i], 4, greedy) for i in range(4)]
    for seq in seqs:
        seq.notify = lambda _s: done.release()

    def on_worker(fn):
        result: list = []
        core.post(lambda: (result.append(fn()), done.release()))
        assert done.acquire(timeout=WAIT_S)
        return result[0]

    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    try:
        assert core.submit(seqs[:3])
        for _ in range(3):
            assert done.acquire(timeout=WAIT_S)
        assert on_worker(core._batch.cache_bytes) > 0
        on_worker(lambda: core.go_to_sleep(1))
        assert on_worker(core._batch.cache_bytes) == 0
        assert on_worker(lambda: core.wake_up(None))
        assert core.submit(seqs[3:])
        assert done.acquire(timeout=WAIT_S)
    finally:
        core.stop()
        worker.join(WAIT_S)
    for seq in seqs:
        assert seq.output_ids == greedy_no_eos(ref_model, seq.prompt_ids, 4), seq.rid
