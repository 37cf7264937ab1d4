"""Sampling for the built-in server: request parameters, logit transforms, token choice.

Pure functions over tensors and records; the core calls `sample` once per decode step for the
whole batch, with the parameters kept as per-row tensors (`BatchSampling`). The logprob reported
for a sampled token is `log_softmax` of the RAW logits (`logprobs_from="raw"`) or of the
temperature-scaled logits (`"scaled"`); top-k/top-p/min-p never enter it, so a trainer can
recompute exactly the same number from one forward pass.
"""

from __future__ import annotations

import dataclasses

import torch

LOGPROBS_FROM = ("raw", "scaled")
GREEDY_BELOW = 1e-6  # SGLang: temperature < 1e-6 means greedy


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingSpec:
    """The validated sampling parameters of one sequence (one prompt, one of its n samples)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    top_logprobs: int = 0  # also return the top-N logprobs of each step

    def __post_init__(self) -> None:
        assert self.max_new_tokens >= 0, f"{self.max_new_tokens=}"
        assert self.temperature >= 0.0, f"{self.temperature=}"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def check_spec(spec: SamplingSpec, names: dict[str, str]) -> SamplingSpec:
    """Range-check a spec; `names` maps spec fields to the wire names used in error messages."""

    def bad(field: str, message: str) -> BadRequest:
        return BadRequest(names.get(field, field), message)

    if spec.max_new_tokens < 0:
        raise bad("max_new_tokens", f"{spec.max_new_tokens} must be >= 0")
    if spec.temperature < 0:
        raise bad("temperature", f"{spec.temperature} must be >= 0")
    if not 0.0 < spec.top_p <= 1.0:
        raise bad("top_p", f"{spec.top_p} must be in (0, 1]")
    if spec.top_k == 0 or spec.top_k < -1:
        raise bad("top_k", f"{spec.top_k} must be -1 (all) or >= 1")
    if not 0.0 <= spec.min_p <= 1.0:
        raise bad("min_p", f"{spec.min_p} must be in [0, 1]")
    if any(not s for s in spec.stop):
        raise bad("stop", "stop strings must be non-empty")
    if any(t < 0 for t in spec.stop_token_ids):
        raise bad("stop_token_ids", f"{spec.stop_token_ids} must be >= 0")
    if not 0 <= spec.top_logprobs <= 20:
        raise bad("top_logprobs", f"{spec.top_logprobs} must be in [0, 20]")
    return spec


def as_type(field: str, value: object, kind: type | tuple[type, ...]) -> object:
    """`value` if it has the wire type `kind` (bools are not ints), else a 400 naming `field`."""
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise BadRequest(field, f"{value!r} must be a number")
    if kind is float:
        kind = (int, float)
    if not isinstance(value, kind):
        raise BadRequest(field, f"{value!r} has the wrong type")
    return value


def as_str_list(field: str, value: object) -> tuple[str, ...]:
    """A stop field (str or list of str) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise BadRequest(field, f"{value!r} must be a string or a list of strings")


def as_int_list(field: str, value: object) -> tuple[int, ...]:
    """A token-id list field as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return tuple(value)
    raise BadRequest(field, f"{value!r} must be a list of token ids")


def filter_logits(
    logits_B_V: torch.Tensor,
    temp_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf outside the nucleus)."""
    assert logits_B_V.dim() == 2, f"{logits_B_V.shape=}"
    scaled = logits_B_V / temp_B.clamp_min(GREEDY_BELOW).unsqueeze(1)
    vocab = scaled.shape[1]
    sorted_vals, sorted_idx = scaled.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k_B = torch.where(top_k_B < 0, torch.full_like(top_k_B, vocab), top_k_B).unsqueeze(1)
    drop = ranks >= k_B
    probs = sorted_vals.softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # mass strictly before each token
    drop |= (before >= top_p_B.unsqueeze(1)) & (top_p_B < 1.0).unsqueeze(1)
    drop |= probs < (min_p_B.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_idx, sorted_vals)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BatchSampling:
    """The sampling parameters of a batch as tensors (one entry per row), for one call.

    `filtered` says whether any row uses top-k/top-p/min-p (else no sort is done); `greedy`
    whether any row is greedy and `sampled` whether any is not. The rows that asked for a seed
    (`seeded_B`; `seeded` / `unseeded`: whether any row is, any is not) draw the uniform of
    their `draw_B`-th token from their `seed_B` (`seeded_uniforms`).
    """

    temp_B: torch.Tensor
    top_k_B: torch.Tensor
    top_p_B: torch.Tensor
    min_p_B: torch.Tensor
    greedy_B: torch.Tensor
    filtered: bool
    greedy: bool
    sampled: bool
    seed_B: torch.Tensor  # int64: a row's seed mod 2**64 as a signed value (`seed_as_int64`)
    draw_B: torch.Tensor  # int64: the tokens a row has drawn so far
    seeded_B: torch.Tensor
    seeded: bool
    unseeded: bool


# splitmix64 (Steele, Lea and Flood 2014): the n-th output of the generator seeded with s is
# mix(s + (n + 1) * GOLDEN), so every seeded row's next uniform is a few int64 tensor ops for the
# whole batch, where a torch.Generator a row cost a call and a store each (128 rows: 0.5 ms a
# decode step on CPU, 7% of the demo model's; on a GPU a host loop each step)
GOLDEN, MIX_1, MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def seed_as_int64(seed: int) -> int:
    """A seed (any int) mod 2**64, as the signed 64-bit value with the same bits."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 bits (torch's `>>` is arithmetic: it copies the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniforms(seed_B: torch.Tensor, draw_B: torch.Tensor) -> torch.Tensor:
    """Each row's `draw_B`-th uniform in [0, 1) of splitmix64 seeded with `seed_B` (float64, the
    output's top 53 bits): a function of the seed and the draw only, whatever else is in the
    batch. int64 products wrap mod 2**64 as the generator's uint64 arithmetic does
    (`tests/rollout/test_seeds.py` checks the bits against plain Python)."""
    x = seed_B + (draw_B + 1) * seed_as_int64(GOLDEN)
    x = (x ^ _shift_right(x, 30)) * seed_as_int64(MIX_1)
    x = (x ^ _shift_right(x, 27)) * seed_as_int64(MIX_2)
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 11).double() * 2.0**-53


def needs_filter(spec: SamplingSpec) -> bool:
    """Whether the spec uses top-k, top-p or min-p (a sampled row only)."""
    return not spec.greedy and (spec.top_k > 0 or spec.top_p < 1.0 or spec.min_p > 0.0)


def sample(
    logits_B_V: torch.Tensor, batch: BatchSampling, logprobs_from: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (greedy or sampled, the whole batch at once) and its logprob.

    Seeded rows draw from their seed and draw count, so their output does not depend on what
    else is in the batch; the others share one draw from the global RNG. Returns (tokens_B,
    logprobs_B).
    """
    assert logits_B_V.dim() == 2, f"{logits_B_V.shape=}"
    assert logprobs_from in LOGPROBS_FROM, f"{logprobs_from=}"
    logits = logits_B_V.float()
    temp_B = batch.temp_B.to(logits.dtype)
    unit = unit_temperature(logits, temp_B)
    if batch.sampled:
        if batch.filtered:
            scaled = filter_logits(logits, temp_B, batch.top_k_B, batch.top_p_B, batch.min_p_B)
        elif unit:
            scaled = logits  # x / 1 is x: no pass over the vocabulary
        else:
            scaled = logits / temp_B.clamp_min(GREEDY_BELOW).unsqueeze(1)
        probs = scaled.softmax(dim=1)
        tokens_B = inverse_cdf(probs, _uniforms(batch, probs.shape[0], probs.device))
        if not batch.filtered and not batch.greedy and (unit or logprobs_from == "scaled"):
            # the logprob asked for is log_softmax(scaled) at the drawn token: the log of its
            # probability (within 1e-6 of float32's log_softmax), not a log_softmax pass over
            # the vocabulary (6-8 ms of a ~290 ms SmolLM2 decode step of 128 rows on one
            # core); a drawn token has mass, so never log(0)
            return tokens_B, probs.gather(1, tokens_B.unsqueeze(1)).squeeze(1).log()
        if batch.greedy:
            tokens_B = torch.where(batch.greedy_B, logits.argmax(dim=1), tokens_B)
    else:
        tokens_B = logits.argmax(dim=1)
    if logprobs_from == "scaled" and not unit:
        logits = logits / torch.where(batch.greedy_B, 1.0, temp_B).unsqueeze(1)
    logprobs_B = logits.log_softmax(dim=1).gather(1, tokens_B.unsqueeze(1)).squeeze(1)
    return tokens_B, logprobs_B


def _uniforms(batch: BatchSampling, rows: int, device: torch.device) -> torch.Tensor:
    """One uniform a row: seeded rows' from their seed and draw count (their draw then depends
    on their probabilities, seed and place in the output only), the others' from the global
    RNG (drawn on the host, as before)."""
    if not batch.seeded:
        return torch.rand(rows, dtype=torch.float64).to(device)
    seeded_B = seeded_uniforms(batch.seed_B, batch.draw_B)
    if not batch.unseeded:
        return seeded_B
    global_B = torch.rand(rows, dtype=torch.float64).to(device)
    return torch.where(batch.seeded_B, seeded_B, global_B)


def unit_temperature(logits_B_V: torch.Tensor, temp_B: torch.Tensor) -> bool:
    """Every row at temperature 1, on CPU: dividing the logits by it would change no bit (a pass
    over the vocabulary: 14 ms of a 288 ms SmolLM2 decode step of 128 rows in bf16 on one core,
    `scripts/profile_decode.py`). On a GPU the check would wait for the device: it is not made."""
    return logits_B_V.device.type == "cpu" and bool((temp_B == 1.0).all())


CDF_BLOCK = 512  # vocabulary entries a block (SmolLM2's 49152 = 96 blocks)


def inverse_cdf(probs_B_V: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative mass first passes `u_B` (in [0, 1)) times the
    row's total: an exact categorical draw, never a token without mass.

    In two levels, each summed in float64 where it is searched: the block (CDF_BLOCK
    entries) by the blocks' masses, then the token within the block by its share of the
    block's mass. `torch.multinomial` draws an exponential per vocabulary entry (80-90 ms of a
    ~180 ms SmolLM2 decode step at 80 rows on 2 CPU cores) and one float64 cumsum over the
    whole vocabulary took 3-28 ms, against under 1 ms here (`scripts/bench_sampling.py`). Block
    masses are float32 sums
    (relative error ~1e-7), so a draw within that of a block boundary may pick the
    neighbouring block's token where one float64 cumsum of the vocabulary would not.
    """
    assert probs_B_V.dim() == 2 and u_B.shape == probs_B_V.shape[:1], f"{probs_B_V.shape=}"
    rows, vocab = probs_B_V.shape
    pad = -vocab % CDF_BLOCK
    padded = torch.nn.functional.pad(probs_B_V, (0, pad)) if pad else probs_B_V
    blocks_B_N_K = padded.reshape(rows, -1, CDF_BLOCK)
    mass_B_N = blocks_B_N_K.sum(dim=2).double()
    cdf_B_N = mass_B_N.cumsum(dim=1)
    target_B1 = (u_B.double() * cdf_B_N[:, -1]).unsqueeze(1)
    block_B1 = _first_past(cdf_B_N, target_B1)
    before_B1 = cdf_B_N.gather(1, block_B1) - mass_B_N.gather(1, block_B1)
    share_B1 = ((target_B1 - before_B1) / mass_B_N.gather(1, block_B1)).clamp(0.0, 1.0)
    index_B1K = block_B1.unsqueeze(2).expand(rows, 1, CDF_BLOCK)
    inner_B_K = blocks_B_N_K.gather(1, index_B1K).squeeze(1).double().cumsum(dim=1)
    within_B1 = _first_past(inner_B_K, share_B1 * inner_B_K[:, -1:])
    return (block_B1 * CDF_BLOCK + within_B1).squeeze(1).clamp_max(vocab - 1)  # NaN rows


def _first_past(cdf_B_N: torch.Tensor, target_B1: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative value exceeds the target (right=True: an entry without
    mass never does); a target at or past the total (rounding) takes the last entry with mass."""
    index_B1 = torch.searchsorted(cdf_B_N, target_B1, right=True)
    total_B1 = cdf_B_N[:, -1:].contiguous()
    last_B1 = torch.searchsorted(cdf_B_N, total_B1, right=False)  # where the total is met
    return torch.minimum(index_B1, last_B1)


def top_logprobs(logits_B_V: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens of each row and their raw logprobs: (logprobs_B_n, ids_B_n)."""
    assert n >= 1, f"{n=}"
    return logits_B_V.float().log_softmax(dim=1).topk(n, dim=1)
