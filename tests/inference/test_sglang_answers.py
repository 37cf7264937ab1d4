"""Reading SGLang's /generate answers (`sglang_wire.parse_generate`) and an engine's JSON
(`http.loads`), and encoding request bodies (`http.dumps`): exact ids and logprobs, the values
the standard library reads and writes, and every malformed answer refused as before."""

from __future__ import annotations

import gc
import json

import httpx
import pytest

from rollouts.inference.http import EngineError, EngineHttp, dumps, loads
from rollouts.inference.sglang_wire import (
    FLAT_KEY,
    batch_generate_body,
    flatten_token_logprobs,
    input_logprobs_body,
    parse_generate,
    parse_input_logprobs,
    parse_input_top_logprobs,
    read_generate,
)
from rollouts.wire.generation import FinishReason, GenerateRequest, SamplingParams


def answer(ids: list, entries: list, reason: dict | None = None) -> dict:
    meta = {
        "output_token_logprobs": entries,
        "finish_reason": reason or {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "weight_version": "7",
    }
    return {"text": "hi", "output_ids": ids, "meta_info": meta}


def test_ids_and_logprobs_come_back_exactly() -> None:
    ids, lps = [5, 300000, 7], [-0.1234567890123, -2.5e-08, 0.0]
    done = parse_generate(answer(ids, [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]))
    assert done.output_ids == (5, 300000, 7)
    assert done.logprobs == tuple(lps)
    assert all(type(t) is int for t in done.output_ids)
    assert done.finish_reason is FinishReason.STOP
    assert done.matched_stop == 2
    assert done.weight_version == "7"
    assert done.completion_tokens == 3


def test_numbers_of_other_types_are_converted_as_before() -> None:
    done = parse_generate(answer([5.0, 6], [[0, 5, None], [-1, 6.0, "x"]]))  # ints, floats
    assert done.output_ids == (5, 6)
    assert all(type(t) is int for t in done.output_ids)
    assert done.logprobs == (0.0, -1.0)
    assert all(type(lp) is float for lp in done.logprobs)
    two_fields = parse_generate(answer([5, 6], [[-0.5, 5], [-0.25, 6]]))
    assert two_fields.logprobs == (-0.5, -0.25)


def test_an_empty_answer_is_an_empty_completion() -> None:
    done = parse_generate(answer([], [], {"type": "abort"}))
    assert done.output_ids == ()
    assert done.logprobs == ()
    assert done.finish_reason is FinishReason.ABORT


def test_malformed_answers_are_refused() -> None:
    with pytest.raises(EngineError, match="differ from output_ids"):
        parse_generate(answer([5, 6], [[-0.5, 5, None], [-0.25, 7, None]]))
    with pytest.raises(EngineError, match="2 logprobs for 3 output tokens"):
        parse_generate(answer([5, 6, 7], [[-0.5, 5, None], [-0.25, 6, None]]))
    with pytest.raises(IndexError):  # an entry with no token id
        parse_generate(answer([5, 6], [[-0.5, 5, None], [-0.25]]))
    with pytest.raises(EngineError, match="no meta_info"):
        parse_generate({"output_ids": [5]})


def test_loads_gives_the_standard_librarys_values() -> None:
    text = b'{"a": [1.5, -0.000123456789012345, 1e-310, 9007199254740993, "\\u00e9"]}'
    assert loads(text) == json.loads(text)
    assert loads(b"[NaN, -Infinity]")[1] == float("-inf")  # what orjson refuses, json reads
    assert loads(b"[18446744073709551616]") == [18446744073709551616]
    with pytest.raises(json.JSONDecodeError):
        loads(b"{not json")


async def test_an_answer_is_read_with_the_collector_off_and_freed_before_it_is_on() -> None:
    seen: list[bool] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'[{"x": [[1, 2, null]]}]')

    def read(body: list) -> int:
        seen.append(gc.isenabled())
        return len(body)

    http = EngineHttp("http://engine", transport=httpx.MockTransport(handler))
    try:
        assert await http.json("POST", "/generate", read=read) == 1
        assert seen == [False]
        assert gc.isenabled()
        bad = httpx.MockTransport(lambda r: httpx.Response(200, content=b"<html>"))
        broken = EngineHttp("http://engine", transport=bad)
        with pytest.raises(EngineError, match="answer is not JSON"):
            await broken.json("GET", "/health")
        await broken.aclose()
    finally:
        await http.aclose()


def test_a_body_is_encoded_to_the_values_httpx_would_send() -> None:
    sampling = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.95, stop=("é", "\n"))
    requests = [
        GenerateRequest(input_ids=(1, 2, 3), sampling=sampling, rid=f"b-g0-s{i}") for i in range(3)
    ]
    body = batch_generate_body(requests, "adapter-1")
    sent = httpx.Request("POST", "http://e/generate", json=body).content
    assert json.loads(dumps(body)) == json.loads(sent) == body | {"input_ids": [[1, 2, 3]] * 3}
    assert dumps({1: [0.1]}) == b'{"1":[0.1]}'  # a key orjson refuses: the standard library's
    with pytest.raises(TypeError):
        dumps({"path": object()})


def parse_before(answer: dict) -> tuple:
    """parse_generate's reading of ids and logprobs before its fast path (2026-12-06), kept
    as the reference the fast path must match: an array check of the ids, zip columns."""
    from array import array
    from operator import itemgetter

    values = answer.get("output_ids", ())
    try:
        array("q", values)
        output_ids = tuple(values)
    except (TypeError, OverflowError):
        output_ids = tuple(map(int, values))
    entries = answer["meta_info"].get("output_token_logprobs") or []
    if len(entries) != len(output_ids):
        raise EngineError(f"{len(entries)} logprobs for {len(output_ids)} output tokens")
    logprobs, ids = (), ()
    if entries:
        columns = tuple(zip(*entries, strict=False))
        if len(columns) < 2:
            columns = tuple(map(itemgetter(0), entries)), tuple(map(itemgetter(1), entries))
        logprobs, ids = columns[0], columns[1]
    if ids != output_ids and tuple(map(int, ids)) != output_ids:
        raise EngineError("output_token_logprobs token ids differ from output_ids")
    return output_ids, tuple(map(float, logprobs))


def outcome(fn, answer: dict) -> tuple:
    """What `fn` gives: ('ok', ids, logprobs, their types) or ('raised', type, message)."""
    try:
        ids, lps = fn(answer)
    except Exception as e:
        return "raised", type(e), str(e)
    return "ok", ids, lps, tuple(map(type, ids)), tuple(map(type, lps))


def fast(answer: dict) -> tuple:
    done = parse_generate(answer)
    return done.output_ids, done.logprobs


def test_the_fast_path_reads_and_refuses_as_before() -> None:
    import random

    rng = random.Random(0)
    answers = []
    for n in [0, 1, 2, 7, 300]:
        ids = [rng.randrange(0, 2**17) for _ in range(n)]
        lps = [-abs(rng.gauss(0.0, 3.0)) for _ in range(n)]
        entries = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        answers.append(answer(ids, entries))
        answers.append(loads(dumps(answer(ids, entries))))  # as the wire gives them
    odd = [  # (output_ids, output_token_logprobs): each shape a server could get wrong
        ([5, 6], [[-0.5, 5, None], [None, 6, None]]),  # a null logprob
        ([5, 6], [[-0.5, 5, None], ["-0.25", 6, None]]),  # a logprob as a string
        ([5, 6], [[-0.5, 5, None], ["x", 6, None]]),
        ([5, 6], [[-0.5, 5, None], [None, 7, None]]),  # null logprob and a wrong id
        ([5, 6], [[-0.5, 5, None], [-0.25]]),  # no token id
        ([5, 6], [[-0.5, 5, None], []]),
        ([5, 6], [[-0.5, 5, None], None]),  # an entry that is no list
        ([5, 6], [[-0.5, 5, None], 3]),
        ([5, 6], [[-0.5, 5, None], {"lp": -0.25, "id": 6}]),
        ([5, 6], [[-0.5, 5, None], "ab"]),
        ([5, 6], {"ab": 1, "cd": 2}),  # entries that are no list
        ([5, 6], "ab"),
        ([5, 6], [[-0.5, 5.0, None], [0, True, "x"]]),  # ids of other types
        ([5.0, 6], [[-0.5, 5, None], [-1, 6, None]]),
        ([5.5, 6], [[-0.5, 5, None], [-1, 6, None]]),
        (["5", 6], [[-0.5, 5, None], [-1, 6, None]]),
        (["x", 6], [[-0.5, 5, None], [-1, 6, None]]),
        ([True, 6], [[-0.5, 1, None], [-1, 6, None]]),
        ([2**70, 6], [[-0.5, 2**70, None], [-1, 6, None]]),
        ([float("nan"), 6], [[-0.5, 5, None], [-1, 6, None]]),
        ([[5], 6], [[-0.5, 5, None], [-1, 6, None]]),
        (None, []),
        ({"a": 1}, [[0.5, "a", None]]),
        ([5, 6], [[-0.5, 5, None]]),  # counts differ
    ]
    answers += [answer(ids, entries) for ids, entries in odd]
    for a in answers:
        assert outcome(fast, a) == outcome(parse_before, a), a


def test_prompt_logprobs_from_a_start_position() -> None:
    """A teacher asks for a response's tokens alone (`logprob_start_len` = its first position):
    the entries read from there; every entry's token id must be its position's, so a server
    that counts positions otherwise is refused, never read one token off."""
    ids = [11, 12, 13, 14, 15]
    assert input_logprobs_body(ids)["logprob_start_len"] == 0  # every token's (the probe)
    assert input_logprobs_body(ids, start=3)["logprob_start_len"] == 3
    whole = [[None, 11, None]] + [[-0.5 * t, t, None] for t in ids[1:]]
    tops = [[]] + [[[-0.1, t, None], [-0.2, 99, None]] for t in ids[1:]]
    meta = {"input_token_logprobs": whole, "input_top_logprobs": tops}
    assert parse_input_logprobs({"meta_info": meta}, ids) == (-6.0, -6.5, -7.0, -7.5)
    tail = {"input_token_logprobs": whole[3:], "input_top_logprobs": tops[3:]}
    assert parse_input_logprobs({"meta_info": tail}, ids, 3) == (-7.0, -7.5)
    assert parse_input_top_logprobs({"meta_info": tail}, ids, 2, 3) == (
        ((14, -0.1), (99, -0.2)),
        ((15, -0.1), (99, -0.2)),
    )
    shifted = {"input_token_logprobs": whole[2:4]}  # one position early
    with pytest.raises(EngineError, match="not token 14"):
        parse_input_logprobs({"meta_info": shifted}, ids, 3)
    with pytest.raises(EngineError, match="input_token_logprobs"):
        parse_input_logprobs({"meta_info": {"input_token_logprobs": whole[3:4]}}, ids, 3)


def from_bytes(answer: dict) -> tuple:
    """What the client reads from the answer's bytes on the wire (compact JSON, as SGLang's
    and the built-in server's), token logprobs decoded flat where they can be."""
    content = json.dumps(answer, separators=(",", ":")).encode()
    done = read_generate(content, parse_generate)
    return done.output_ids, done.logprobs


def test_answers_read_from_their_bytes_as_before() -> None:
    import random

    rng = random.Random(1)
    answers = []
    for n in [1, 2, 7, 300]:
        ids = [rng.randrange(0, 2**17) for _ in range(n)]
        lps = [-abs(rng.gauss(0.0, 3.0)) for _ in range(n)]
        answers.append(answer(ids, [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]))
    odd = [  # shapes whose bytes are numbers and nulls, yet no [logprob, id, null] triples
        ([5, 6], [[-0.5, 5], [-0.25, 6]]),  # pairs
        ([5, 6, 7], [[-0.5, 5], [-0.25, 6], [-1.0, 7]]),  # pairs, 6 numbers: two "triples"
        ([5, 6], [[-0.5, 5, None, None], [-0.25, 6]]),
        ([5, 6], [[-0.5, [5], None], [-0.25, 6, None]]),  # a nested id
        ([5, 6], [[-0.5, 5, None], [None, 6, None]]),  # a null logprob
        ([5, 6], [[-0.5, 5, None], [-0.25, 7, None]]),  # a wrong id
        ([5, 6], [[-0.5, 5, None], [-0.25, 6.0, None]]),  # a float id
        ([5, 6], [[-0.5, 5, None], [-0.25, 6.5, None]]),
        ([5, 6, 7], [[-0.5, 5, None], [-0.25, 6, None]]),  # counts differ
        ([5], [[-0.5, 5, None], [-0.25, 6, None]]),
        ([5], [[-0.5, 5, 1]]),  # a number where the text is
        ([5], [[-0.5, 5, "a"]]),  # a text
        ([5, 6], [[-0.5, 5, None], []]),
        ([], [[]]),
        ([], [[], []]),
        ([5], [[-1e-300, 5, None]]),
        ([5], [[0, 5, None]]),  # an integer logprob
    ]
    answers += [answer(ids, entries) for ids, entries in odd]
    answers.append(answer([5], [[-0.5, 5, None]]) | {"extra": {"output_token_logprobs": [[1]]}})
    for a in answers:
        assert outcome(from_bytes, a) == outcome(parse_before, a), a


def test_compact_entries_are_decoded_flat_and_others_as_they_were() -> None:
    compact = b'{"output_ids":[5,6],"meta_info":{"output_token_logprobs":[[-0.5,5,null],'
    compact += b'[-2.5e-08,6,null]],"weight_version":"1"}}'
    flat = flatten_token_logprobs(compact)
    assert b"output_token_logprobs" not in flat
    assert loads(flat)["meta_info"][FLAT_KEY] == [2, -0.5, 5, None, -2.5e-08, 6, None]
    last = compact.replace(b',"weight_version":"1"', b"")  # the entries end meta_info
    assert loads(flatten_token_logprobs(last))["meta_info"][FLAT_KEY][-3:] == [-2.5e-08, 6, None]
    batch = b"[" + compact + b"," + last + b"]"
    assert flatten_token_logprobs(batch).count(FLAT_KEY.encode()) == 2
    for kept in (
        compact.replace(b"null],", b"null], "),  # whitespace
        compact.replace(b"5,null]", b'5,"hi"]'),  # a token's text
        compact.replace(b"-0.5", b"NaN"),
    ):
        assert flatten_token_logprobs(kept) is kept
    done = read_generate(compact, parse_generate)
    assert done.output_ids == (5, 6)
    assert done.logprobs == (-0.5, -2.5e-08)
    assert done.weight_version == "1"
