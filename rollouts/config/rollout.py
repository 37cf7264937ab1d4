"""[rollout] (with [rollout.sampling]) and [engines] sections ([engines.builtin]: the built-in
engine's options, `engine_options.py`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _one_of, _Section
from rollouts.config.engine_options import EngineOptions
from rollouts.config.gateway import GatewayConfig, gateway_problems
from rollouts.engine_kinds import ENGINE_KINDS, LogprobsFrom, engine_kind

RolloutMode = Literal["sync", "async"]
OnShortBatch = Literal["warn", "error"]  # train on a smaller batch | stop the run
ServedLogprobs = Literal["auto", "raw", "scaled"]  # SGLang / vLLM servers; auto: their default


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig(_Section):
    """[rollout.sampling]: sampling parameters sent to the engines."""

    KEY: ClassVar[str] = "rollout.sampling"

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            self.max_new_tokens >= 1,
            f"rollout.sampling.max_new_tokens = {self.max_new_tokens}: must be >= 1",
        )
        _check(
            p,
            self.temperature >= 0.0,
            f"rollout.sampling.temperature = {self.temperature}: must be >= 0 (0 = greedy)",
        )
        _check(p, 0.0 < self.top_p <= 1.0, f"rollout.sampling.top_p = {self.top_p}: in (0, 1]")
        _check(p, self.top_k == -1 or self.top_k >= 1, "rollout.sampling.top_k: -1 or >= 1")
        _check(p, 0.0 <= self.min_p < 1.0, f"rollout.sampling.min_p = {self.min_p}: in [0, 1)")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig(_Section):
    """[rollout]: how batches of groups are generated, filtered and kept."""

    KEY: ClassVar[str] = "rollout"

    batch_size: int = 8  # groups (prompts) per training batch
    n_samples_per_prompt: int = 4
    over_sampling_factor: float = 1.5
    # samples in flight at once, over all engines; 0 = the built-in engines' capacity
    # (num_engines x max_batch: a batch of 80 samples under a bound of 64 ran its last 2 groups
    # after the first 8), or 64 for SGLang / vLLM servers (set it to their batch capacity)
    max_concurrency: int = 0
    max_over_sampling_rounds: int = 4
    on_short_batch: OnShortBatch = "warn"
    # aborted groups resume in a later batch; off: they restart from their prompts
    partial_rollouts: bool = True
    mask_off_policy_partial: bool = False
    filters: list[str] = dataclasses.field(default_factory=list)  # dotted paths or built-in names
    generate_fn: str = ""  # dotted path; "" = the engine pool
    # the default generate fn sends a group's samples as one request to engines that batch
    # (SGLang's API, the built-in server); false: one request per sample
    batch_groups: bool = True
    reward_fn: str = ""  # dotted path, or a name: "math" (rollouts/rewards/named.py), "judge"
    env: str = ""  # dotted path or built-in env name; "" = single-turn
    max_turns: int = 1
    max_total_tokens: int = 1024
    generate_timeout_s: float = 300.0
    env_timeout_s: float = 60.0  # per env factory / env.reset / env.step call (tools: per Tool)
    reward_timeout_s: float = 10.0
    mode: RolloutMode = "sync"
    # versions a trained sample may lag the policy, in both modes; -1 = automatic: what a fresh
    # sample can lag (weight_sync.every - 1, + 1 in async), so sync mode stays on-policy and
    # only resumed partial work is dropped (before it is resumed)
    max_staleness: int = -1
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    # the OpenAI-compatible gateway (generate_fn = "rollouts.gateway.agent_generate")
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)

    def problems(self) -> list[str]:
        p: list[str] = gateway_problems(self.generate_fn, self.gateway)
        _check(p, self.batch_size >= 1, f"rollout.batch_size = {self.batch_size}: must be >= 1")
        _check(
            p,
            self.n_samples_per_prompt >= 1,
            f"rollout.n_samples_per_prompt = {self.n_samples_per_prompt}: must be >= 1",
        )
        _check(
            p,
            self.over_sampling_factor >= 1.0,
            f"rollout.over_sampling_factor = {self.over_sampling_factor}: must be >= 1.0",
        )
        _check(
            p, self.max_concurrency >= 0, "rollout.max_concurrency: must be >= 1 (0 = automatic)"
        )
        _check(
            p, self.max_over_sampling_rounds >= 1, "rollout.max_over_sampling_rounds: must be >= 1"
        )
        _check(p, self.max_turns >= 1, f"rollout.max_turns = {self.max_turns}: must be >= 1")
        _check(
            p,
            self.max_staleness >= -1,
            f"rollout.max_staleness = {self.max_staleness}: must be >= 0, or -1 (automatic)",
        )
        _check(p, self.generate_timeout_s > 0, "rollout.generate_timeout_s: must be > 0")
        _check(p, self.env_timeout_s > 0, "rollout.env_timeout_s: must be > 0")
        _check(p, self.reward_timeout_s > 0, "rollout.reward_timeout_s: must be > 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EnginesConfig(_Section):
    """[engines]: the inference servers: built-in ones this run starts ([engines.builtin]), or
    SGLang / vLLM servers already up at `urls`."""

    KEY: ClassVar[str] = "engines"

    kind: str = "builtin"  # a name of ENGINE_KINDS (rollouts/engine_kinds.py)
    urls: list[str] = dataclasses.field(default_factory=list)  # servers not started here
    api_key: str = ""
    # every HTTP call (a generation, a weight reload); a hung engine is caught sooner, by
    # stall_timeout_s. The GPU presets raise it for long generations and big reloads
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 120.0  # built-in engines' start; /health wait for URLs
    health_interval_s: float = 5.0
    max_retries: int = 3
    wait_for_up_s: float = 60.0  # with every engine down, how long a request or a sync waits
    # silent on /health this long: hung; marked down, its requests go to the other engines
    stall_timeout_s: float = 15.0
    # colocated sync mode: the engines release their memory while the trainer trains (vLLM's
    # sleep levels: 1 keeps the weights in host memory, 2 discards them; the step's weight sync
    # reloads them after the wake-up). 0 = they stay awake
    sleep_level: int = 0
    # which logits the SGLang / vLLM servers' sampled-token logprobs come from; "auto": each
    # server's default (`engine_logprobs`). The built-in engines': builtin.logprobs_from
    served_logprobs: ServedLogprobs = "auto"
    # generation requests and the decode of their answers in this many worker processes
    # (`rollouts/inference/client_procs.py`), off the driver's thread: for cluster batch sizes,
    # where that thread is the limit (`scripts/bench_driver.py`). 0: in the driver's process
    client_processes: int = 0
    builtin: EngineOptions = dataclasses.field(default_factory=EngineOptions)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.max_retries >= 0, "engines.max_retries: must be >= 0")
        _check(
            p,
            0 <= self.client_processes <= 64,
            f"engines.client_processes = {self.client_processes}: must be 0 (in the driver's "
            "process) to 64",
        )
        _check(
            p,
            self.request_timeout_s > 0,
            f"engines.request_timeout_s = {self.request_timeout_s}: must be > 0",
        )
        _check(
            p,
            self.health_interval_s > 0,
            f"engines.health_interval_s = {self.health_interval_s}: must be > 0",
        )
        _check(
            p,
            self.stall_timeout_s > 0,
            f"engines.stall_timeout_s = {self.stall_timeout_s}: must be > 0",
        )
        _check(
            p,
            self.wait_for_up_s >= 0,
            f"engines.wait_for_up_s = {self.wait_for_up_s}: must be >= 0",
        )
        _check(
            p,
            self.sleep_level in (0, 1, 2),
            f"engines.sleep_level = {self.sleep_level}: must be 0 (awake), 1 or 2",
        )
        _one_of(p, "engines.kind", self.kind, tuple(ENGINE_KINDS))
        if self.kind in ENGINE_KINDS:
            p += self._kind_problems()
        return p

    def _kind_problems(self) -> list[str]:
        """What the kind asks of the other keys: URLs of servers not started here; no
        `served_logprobs` for engines started here (their own option says it)."""
        p: list[str] = []
        here = engine_kind(self.kind).started_here
        _check(
            p,
            here or bool(self.urls),
            f"engines.urls: must list the server URLs when engines.kind = {self.kind!r}",
        )
        _check(
            p,
            not here or self.served_logprobs == "auto",
            f"engines.served_logprobs = {self.served_logprobs!r} with engines.kind = "
            f"{self.kind!r}: it describes servers the run does not start; set "
            "engines.builtin.logprobs_from instead",
        )
        return p


def engine_logprobs(engines: EnginesConfig) -> LogprobsFrom:
    """Which logits the engines' sampled-token logprobs come from: "raw" or "scaled" (by the
    sampling temperature). SGLang's own default is "scaled" (its sampler returns log(softmax(
    logits / T)) unless SGLANG_RETURN_ORIGINAL_LOGPROB is set); vLLM's is "raw"
    (`--logprobs-mode raw_logprobs`)."""
    kind = engine_kind(engines.kind)
    if kind.started_here:
        return engines.builtin.logprobs_from
    if engines.served_logprobs != "auto":
        return engines.served_logprobs
    return kind.served_logprobs


EXTERNAL_CONCURRENCY = 64  # rollout.max_concurrency = 0 with SGLang / vLLM servers


def resolved_concurrency(rollout: RolloutConfig, engines: EnginesConfig) -> int:
    """`rollout.max_concurrency`, its 0 resolved: the built-in engines' capacity (every engine's
    max_batch), else EXTERNAL_CONCURRENCY."""
    if rollout.max_concurrency:
        return rollout.max_concurrency
    if engine_kind(engines.kind).started_here:
        return engines.builtin.num_engines * engines.builtin.max_batch
    return EXTERNAL_CONCURRENCY
