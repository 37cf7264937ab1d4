"""Pure decisions of the engine server and clients, tested without any server."""

from __future__ import annotations

import httpx
import pytest
import torch

from rollouts.engine.sampling import (
    BadRequest,
    BatchSampling,
    SamplingSpec,
    filter_logits,
    needs_filter,
    sample,
    seed_as_int64,
)
from rollouts.engine.scheduler import (
    admit_count,
    allowed_new_tokens,
    can_enqueue,
    find_stop,
    stop_after_token,
    trim_text,
)
from rollouts.engine.wire import openai_spec, sglang_spec
from rollouts.inference.http import EngineHttp, EngineRequestError, EngineUnavailable, HttpOptions
from rollouts.inference.pool import pick_engine
from rollouts.inference.sglang_wire import generate_body
from rollouts.inference.vllm import completion_body
from rollouts.wire.generation import FinishReason, SamplingParams


def choose_tokens(
    logits_B_V: torch.Tensor,
    specs: list[SamplingSpec],
    seeds: list[int | None],
    logprobs_from: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` of each row's first token for rows given as specs and seeds (the server builds
    the same batch from its slots, `rows.SlotTable.sampling`); returns (tokens_B, logprobs_B)."""
    assert len(specs) == len(seeds) == logits_B_V.shape[0], f"{logits_B_V.shape=}"
    greedy = [s.greedy for s in specs]
    seeded = [seed is not None for seed in seeds]
    batch = BatchSampling(
        temp_B=torch.tensor([s.temperature for s in specs]),
        top_k_B=torch.tensor([s.top_k for s in specs]),
        top_p_B=torch.tensor([s.top_p for s in specs]),
        min_p_B=torch.tensor([s.min_p for s in specs]),
        greedy_B=torch.tensor(greedy),
        filtered=any(needs_filter(s) for s in specs),
        greedy=any(greedy),
        sampled=not all(greedy),
        seed_B=torch.tensor([seed_as_int64(seed or 0) for seed in seeds]),
        draw_B=torch.zeros(len(seeds), dtype=torch.long),
        seeded_B=torch.tensor(seeded),
        seeded=any(seeded),
        unseeded=not all(seeded),
    )
    return sample(logits_B_V, batch, logprobs_from)


def test_admission_fills_free_slots_up_to_the_prefill_cap() -> None:
    assert admit_count(active=60, waiting=10, max_batch=64, max_prefill=64) == 4
    assert admit_count(active=0, waiting=100, max_batch=64, max_prefill=16) == 16
    assert admit_count(active=64, waiting=5, max_batch=64, max_prefill=8) == 0
    assert can_enqueue(queued=3, max_queue=4) and not can_enqueue(queued=4, max_queue=4)
    assert allowed_new_tokens(prompt_len=500, max_new_tokens=64, context_len=512) == 12


def _stop(**kw: object) -> object:
    base = dict(
        token=7,
        num_output=1,
        max_new_tokens=10,
        stop_token_ids=(),
        eos_token_ids=(2,),
        ignore_eos=False,
        text=None,
        stop=(),
        text_before_len=0,
    )
    return stop_after_token(**{**base, **kw})


def test_stop_rules_in_order() -> None:
    assert _stop() is None
    assert _stop(token=9, stop_token_ids=(9,)).matched == 9
    assert _stop(token=2).reason is FinishReason.STOP
    assert _stop(token=2, ignore_eos=True) is None
    assert _stop(num_output=10).reason is FinishReason.LENGTH
    hit = _stop(text="abcXY", stop=("XY",), text_before_len=4)
    assert (hit.reason, hit.matched) == (FinishReason.STOP, "XY")
    assert find_stop("abcXY", ("XY", "c"), 4) == (3, "XY")  # only matches touching new text
    assert find_stop("abcXYz", ("XY",), 5) is None
    assert trim_text("ab<s>cd", ("<s>",), "<s>", keep=False) == "ab"
    assert trim_text("ab<s>cd", ("<s>",), "<s>", keep=True) == "ab<s>"


def test_filter_logits_top_k_top_p_min_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)

    def kept(top_k: int, top_p: float, min_p: float) -> list[bool]:
        out = filter_logits(logits, one, torch.tensor([top_k]), one * top_p, one * min_p)
        return torch.isfinite(out)[0].tolist()

    assert kept(2, 1.0, 0.0) == [True, True, False, False]
    assert kept(-1, 0.7, 0.0) == [True, True, False, False]
    assert kept(-1, 1.0, 0.2) == [True, True, True, False]


def test_choose_tokens_greedy_logprob_raw_and_scaled() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 1.0]])
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.5, top_k=1)]
    tokens, raw = choose_tokens(logits, specs, [None, None], "raw")
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(raw, logits.log_softmax(1)[[0, 1], [1, 0]])
    _, scaled = choose_tokens(logits, specs, [None, None], "scaled")
    assert torch.allclose(scaled[0], raw[0])  # greedy rows report raw
    assert torch.allclose(scaled[1], (logits[1] / 0.5).log_softmax(0)[0])


def test_sampled_logprobs_are_log_softmax_at_the_drawn_token() -> None:
    # the drawn token's probability gives its logprob (no log_softmax pass over the
    # vocabulary): it must equal log_softmax of the raw logits at temperature 1 and of the
    # scaled ones with "scaled"; "raw" at another temperature and top-k rows take log_softmax
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen) * 4.0
    logits[0, 7] = 60.0  # a row with one token far ahead
    rows = torch.arange(64)
    for temperature, logprobs_from, top_k in [
        (1.0, "raw", -1),
        (1.0, "scaled", -1),
        (0.7, "scaled", -1),
        (0.7, "raw", -1),
        (1.0, "raw", 20),
    ]:
        specs = [SamplingSpec(temperature=temperature, top_k=top_k)] * 64
        tokens, lps = choose_tokens(logits, specs, [None] * 64, logprobs_from)
        ref = logits if logprobs_from == "raw" else logits / temperature
        exact = ref.double().log_softmax(1)[rows, tokens]
        # no further from float64's than torch's own float32 log_softmax: 7.4e-6 of it on a CPU
        # with AVX-512, 1.6e-5 with AVX2 alone (a Zen 3), whose kernels sum the vocabulary in
        # another order
        f32 = ref.log_softmax(1)[rows, tokens].double()
        bound = (f32 - exact).abs().max().item() + 2e-6
        assert bound < 5e-5, bound
        assert (lps.double() - exact).abs().max().item() <= bound, (temperature, top_k)
    assert tokens[0].item() == 7
    # the draws follow the distribution: 4000 draws of one row of 3 tokens
    probs = torch.tensor([0.6, 0.3, 0.1])
    spec = SamplingSpec(temperature=1.0)
    row = probs.log().expand(4000, 3).contiguous()
    tokens, lps = choose_tokens(row, [spec] * 4000, [None] * 4000, "raw")
    share = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(share, probs, atol=0.03), share
    assert torch.allclose(lps, probs.log()[tokens], atol=1e-6)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    spec = SamplingSpec(temperature=1.0, seed=7)

    def draw(rows: int) -> list[int]:
        return choose_tokens(logits[:rows], [spec] * rows, [7] * rows, "raw")[0].tolist()

    assert draw(3)[0] == draw(1)[0]


def test_wire_parsing_is_strict_and_names_the_field() -> None:
    spec, n = sglang_spec({"max_new_tokens": 5, "temperature": 0, "n": 3, "stop": "x"}, 0)
    assert (spec.max_new_tokens, spec.greedy, n, spec.stop) == (5, True, 3, ("x",))
    with pytest.raises(BadRequest, match="sampling_params.bogus"):
        sglang_spec({"bogus": 1}, 0)
    with pytest.raises(BadRequest, match="sampling_params.max_new_tokens"):
        sglang_spec({"max_new_tokens": -1}, 0)
    with pytest.raises(BadRequest, match="sampling_params.top_p"):
        sglang_spec({"top_p": 0.0}, 0)
    spec, n, extra = openai_spec({"prompt": [1], "include_stop_str_in_output": True}, {"prompt"})
    assert (spec.max_new_tokens, spec.no_stop_trim, n, extra) == (16, True, 1, {"prompt": [1]})
    with pytest.raises(BadRequest, match="max_tokens"):
        openai_spec({"max_tokens": -3}, set())
    with pytest.raises(BadRequest, match="frequency_penalty"):
        openai_spec({"frequency_penalty": 0.5}, set())


def test_client_bodies_use_the_wire_field_names() -> None:
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, stop=("\n",), seed=3)
    body = generate_body([1, 2], sampling, "r1")
    assert set(body) == {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "rid",
    }
    assert set(body["sampling_params"]) == {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "sampling_seed",
    }
    assert body["return_logprob"] is True and body["sampling_params"]["sampling_seed"] == 3
    body = completion_body([1, 2], sampling, "r1", None)
    assert set(body) == {
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "n",
        "logprobs",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "return_weight_versions",
        "seed",
        "request_id",
    }
    assert body["max_tokens"] == 8 and body["logprobs"] == 0 and body["prompt"] == [1, 2]
    # both clients decode alike (slime's choice): no spaces between special tokens
    assert body["spaces_between_special_tokens"] is False
    sglang_params = generate_body([1], sampling, None)["sampling_params"]
    assert sglang_params["spaces_between_special_tokens"] is False


def test_pick_engine_least_loaded_up_untried() -> None:
    assert pick_engine([3, 1, 2], [True, True, True], set()) == 1
    assert pick_engine([3, 1, 2], [True, False, True], set()) == 2
    assert pick_engine([3, 1, 2], [True, False, True], {2}) == 0
    assert pick_engine([0, 0], [False, False], set()) is None


async def test_http_retries_connection_errors_bounded_and_never_4xx() -> None:
    calls: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    options = HttpOptions(max_retries=2, backoff_s=0.001)
    client = EngineHttp("http://e", options=options, transport=httpx.MockTransport(refuse))
    with pytest.raises(EngineUnavailable, match="after 2 retries"):
        await client.call("GET", "/x")
    assert len(calls) == 3
    await client.aclose()

    def bad(request: httpx.Request) -> httpx.Response:
        calls.append("bad")
        return httpx.Response(400, json={"error": {"message": "top_p: must be in (0, 1]"}})

    client = EngineHttp("http://e", options=options, transport=httpx.MockTransport(bad))
    with pytest.raises(EngineRequestError, match="top_p") as info:
        await client.call("POST", "/generate", json_body={})
    assert info.value.status == 400 and calls.count("bad") == 1
    await client.aclose()


def test_core_queue_is_bounded() -> None:
    from rollouts.engine.core import CoreOptions, EngineCore, Sequence

    core = EngineCore(None, None, CoreOptions(max_queue=2), "v0")

    def seq(i: int) -> Sequence:
        return Sequence(rid=str(i), prompt_ids=[1], spec=SamplingSpec(), max_new=1, notify=print)

    assert core.submit([seq(0), seq(1)])
    assert not core.submit([seq(2)])
    assert core.load() == (0, 2)


def test_factory_picks_the_client_by_kind() -> None:
    from rollouts.config import EnginesConfig
    from rollouts.inference.factory import make_pool
    from rollouts.inference.sglang import SGLangEngine
    from rollouts.inference.vllm import VLLMEngine

    pool = make_pool(EnginesConfig(kind="vllm", urls=["http://a:1"]), ["http://a:1"])
    assert isinstance(pool.engines[0], VLLMEngine)
    pool = make_pool(EnginesConfig(), ["http://b:2", "http://c:3"])
    assert all(isinstance(e, SGLangEngine) for e in pool.engines) and len(pool.engines) == 2
