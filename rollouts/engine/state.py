"""The trio side of the server: turns route calls into worker commands and waits for results."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from rollouts.engine.core import EngineCore, PromptLogprob, Sequence
from rollouts.engine.sampling import BadRequest, SamplingSpec
from rollouts.engine.scheduler import Stop, allowed_new_tokens
from rollouts.engine.sleep import AsleepError
from rollouts.engine.weights import WeightLoadError
from rollouts.wire.generation import PAUSE_MODES, FinishReason, PauseMode

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 600.0
SEED_MODULUS = 2**64  # sample i of a seeded request uses (seed + i) mod 2**64


class ServiceUnavailable(RuntimeError):
    """The server cannot take the request now (queue full, paused): HTTP 503."""


class WeightPathForbidden(WeightLoadError):
    """A reload from outside every `--weights-root`: HTTP 403."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServerInfo:
    """What the info routes report."""

    model_path: str
    served_model_name: str
    context_len: int
    vocab_size: int
    max_batch: int
    max_queue: int
    logprobs_from: str
    request_timeout_s: float
    weights_roots: tuple[str, ...] = ()  # reloads only from inside these (none: anywhere)
    max_prompt_chars: int = 0  # a longer text prompt can never fit the context (0 = no bound)
    max_body_bytes: int = 64 * 2**20  # a longer request body is refused with 413


class ServerState:
    """Shared by all routes: the core, the tokenizer, the pause state."""

    def __init__(self, core: EngineCore, info: ServerInfo, token: trio.lowlevel.TrioToken) -> None:
        self.core, self.info, self.token = core, info, token
        self.tokenizer = core.tokenizer
        self.reject_new = False  # vLLM pause in abort/wait mode: new requests get 503
        self.sglang_pause: str | None = None  # the /pause_generation mode until a resume
        self._ids = itertools.count()
        self._tokenizing = trio.CapacityLimiter(1)  # one encode at a time, off the event loop

    async def encode(self, text: str, field: str) -> list[int]:
        """Token ids of a text prompt, encoded in a thread so the event loop keeps serving; a
        text too long to ever fit the context is a 400 before any work."""
        bound = self.info.max_prompt_chars
        if bound and len(text) > bound:
            raise BadRequest(
                field,
                f"the text has {len(text)} characters; no text over {bound} fits the context "
                f"of {self.info.context_len} tokens",
            )
        return await trio.to_thread.run_sync(
            lambda: self.tokenizer.encode(text, add_special_tokens=False),
            limiter=self._tokenizing,
        )

    def check_weights_path(self, path: str) -> None:
        """403 unless `path` (links resolved) is inside a `--weights-root` (when any is set)."""
        roots = [Path(r).resolve() for r in self.info.weights_roots]
        if roots and not any(Path(path).resolve().is_relative_to(r) for r in roots):
            raise WeightPathForbidden(
                f"model_path {path!r} is outside the server's --weights-root "
                f"({', '.join(map(str, roots))})"
            )

    def check_count(self, count: int, field: str) -> None:
        """400 for a request of more sequences than the waiting queue can ever hold."""
        if count > self.info.max_queue:
            raise BadRequest(
                field,
                f"the request asks for {count} sequences; at most {self.info.max_queue} "
                "can ever be queued (--max-queue)",
            )

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    def check_prompt(self, prompt_ids: list[int], field: str) -> None:
        """400 for an empty prompt, a token outside the vocabulary, or a prompt too long."""
        if not prompt_ids:
            raise BadRequest(field, "the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise BadRequest(field, f"token ids {bad[:5]} are outside [0, {self.info.vocab_size})")
        if len(prompt_ids) >= self.info.context_len:
            raise BadRequest(
                field,
                f"the prompt has {len(prompt_ids)} tokens; the context is {self.info.context_len}",
            )

    async def generate(
        self, prompt_ids: list[int], spec: SamplingSpec, rid: str, n: int
    ) -> list[Sequence]:
        """Generate n sequences for one prompt; waits for all (an abort returns partial ones)."""
        results = await self.generate_many([(prompt_ids, spec, rid, n)])
        return results[0]

    async def generate_many(
        self, prompts: list[tuple[list[int], SamplingSpec, str, int]]
    ) -> list[list[Sequence]]:
        """Submit every sequence of every prompt at once, so they share the batch. When the
        caller gives up (timeout, client gone: any cancellation) its sequences are aborted."""
        if self.reject_new:
            raise ServiceUnavailable("the server is paused; POST /resume first")
        if self.core.sleep.weights_lost:
            raise ServiceUnavailable(
                "a level-2 sleep discarded the weights: reload them before generating"
            )
        self.check_count(sum(n for *_, n in prompts), "n")
        events: list[trio.Event] = []
        groups = [self._sequences(*prompt, events) for prompt in prompts]
        seqs = [s for g in groups for s in g if s.max_new > 0]
        for seq in (s for g in groups for s in g if s.max_new == 0):  # nothing to generate:
            self._finish_now(seq)  # a scoring request (prompt logprobs) skips the batch
        if seqs and not self.core.submit(seqs):
            running, waiting = self.core.load()
            raise ServiceUnavailable(
                f"the waiting queue is full: {waiting} sequences wait ({running} running), "
                f"this request adds {len(seqs)}, --max-queue is {self.info.max_queue}"
            )
        try:
            with trio.fail_after(self.info.request_timeout_s):
                for event in events:
                    await event.wait()
        except BaseException:
            ours = {id(s): s for s in seqs}  # holds them, so no other sequence takes an id
            self.core.post(lambda: self.core.abort_where(lambda s: ours.get(id(s)) is s))
            raise
        return groups

    def _sequences(
        self, prompt_ids: list[int], spec: SamplingSpec, rid: str, n: int, events: list
    ) -> list[Sequence]:
        """The n sequences of one prompt (sample i seeded with seed + i), one event each."""
        group = []
        for i in range(n):
            event = trio.Event()
            events.append(event)
            seed = None if spec.seed is None else (spec.seed + i) % SEED_MODULUS
            group.append(
                Sequence(
                    rid=rid if n == 1 else f"{rid}-{i}",
                    prompt_ids=prompt_ids,
                    spec=spec,
                    max_new=allowed_new_tokens(
                        prompt_len=len(prompt_ids),
                        max_new_tokens=spec.max_new_tokens,
                        context_len=self.info.context_len,
                    ),
                    notify=self._notifier(event),
                    seed=seed,
                    request=rid,
                )
            )
        return group

    def _finish_now(self, seq: Sequence) -> None:
        """Answer a sequence with no token to generate at once, as the weights served now."""
        seq.stop = Stop(reason=FinishReason.LENGTH, matched=None)
        seq.weight_version = self.core.weight_version
        seq.notify(seq)

    def _notifier(self, event: trio.Event) -> Callable[[Sequence], None]:
        def notify(_seq: Sequence) -> None:
            self.token.run_sync_soon(event.set)

        return notify

    async def command(self, fn: Callable[[Callable[[Any], None]], None]) -> Any:
        """Run `fn(reply)` in the worker; returns what it passes to `reply` (or raises it)."""
        done = trio.Event()
        box: list[Any] = []

        def reply(value: Any) -> None:
            box.append(value)
            self.token.run_sync_soon(done.set)

        def guarded() -> None:
            try:
                fn(reply)
            except Exception as exc:
                reply(exc)

        self.core.post(guarded)
        with trio.fail_after(COMMAND_TIMEOUT_S):
            await done.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    async def abort(self, rid_prefix: str | None) -> int:
        """Abort all (or matching) requests; they answer with partial output."""
        return await self.command(lambda reply: reply(self.core.abort(rid_prefix)))

    async def abort_requests(self, ids: set[str]) -> int:
        """Abort the sequences of the requests with these exact ids (vLLM's semantics)."""
        hit = lambda s: s.request in ids  # noqa: E731
        return await self.command(lambda reply: reply(self.core.abort_where(hit)))

    async def pause(self, mode: PauseMode, *, reject_new: bool) -> None:
        """abort: abort in-flight; wait: let them finish; keep: freeze them. Then stop stepping."""
        assert mode in PAUSE_MODES, f"{mode=} not in {PAUSE_MODES}"
        self.reject_new = reject_new and mode != "keep"

        def run(reply: Callable[[Any], None]) -> None:
            if mode == "abort":
                self.core.abort(None)
            if mode == "wait":

                def pause_now() -> None:
                    self.core.paused = True
                    reply(None)

                self.core.when_idle(pause_now)
                return
            self.core.paused = True
            reply(None)

        await self.command(run)

    async def resume(self) -> None:
        """Undo pause: new requests are taken again and frozen ones continue."""
        self.reject_new = False
        self.sglang_pause = None

        def run(reply: Callable[[Any], None]) -> None:
            self.core.paused = False
            reply(None)

        await self.command(run)

    async def reload(self, path: str, version: str | None, abort_first: bool) -> None:
        """Load new weights: at once when paused, else after the running requests finish. On a
        failure the old weights and version stay (every file is read before any is copied)."""
        self.check_weights_path(path)

        def load() -> None:
            try:
                self.core.reload(path, version)
            except AsleepError:  # a 503: wake the weights first
                raise
            except Exception as exc:
                log.warning("weight reload from %s failed: %s", path, exc)
                message = str(exc) if isinstance(exc, WeightLoadError) else f"{path}: {exc!r}"
                raise WeightLoadError(message) from exc

        abort = (lambda: self.core.abort(None)) if abort_first else None
        await self._between_requests(load, first=abort)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter as `name` (merged into the served weights): at once when paused,
        else after the running requests finish, like a weight reload."""
        self.check_weights_path(path)

        def load() -> None:
            try:
                self.core.load_adapter(name, path)
            except AsleepError:
                raise
            except Exception as exc:
                log.warning("loading LoRA adapter %r from %s failed: %s", name, path, exc)
                if isinstance(exc, ValueError):
                    raise
                raise WeightLoadError(repr(exc)) from exc

        await self._between_requests(load)

    async def _between_requests(
        self, load: Callable[[], None], first: Callable[[], Any] | None = None
    ) -> None:
        """Run `load` in the worker at once when paused, else once the running requests
        finished (after `first()`, e.g. aborting them all); what it raises is the answer."""

        def run(reply: Callable[[Any], None]) -> None:
            if first is not None:
                first()

            def attempt() -> None:  # may run later, from the worker loop: must always reply
                try:
                    load()
                except Exception as exc:
                    reply(exc)
                    return
                reply(None)

            if self.core.paused:
                attempt()
            else:
                self.core.when_idle(attempt)

        await self.command(run)

    async def unload_adapter(self, name: str) -> None:
        """Forget LoRA adapter `name` (an AdapterError when it is not loaded)."""

        def run(reply: Callable[[Any], None]) -> None:
            self.core.unload_adapter(name)
            reply(None)

        await self.command(run)

    def check_adapter(self, name: Any, field: str) -> None:
        """SGLang's `lora_path` of a request: absent, or a loaded adapter's name (else 400, as
        SGLang refuses an adapter it has not loaded)."""
        if name is None:
            return
        if not isinstance(name, str) or not self.core.adapters.knows(name):
            loaded = sorted(self.core.adapters.loaded)
            raise BadRequest(field, f"the LoRA adapter {name!r} is not loaded (loaded: {loaded})")

    async def prompt_logprobs(
        self, prompt_ids: list[int], top: int, start: int = 1
    ) -> list[PromptLogprob]:
        """The served weights' logprob of each prompt token from position `start` on
        (`EngineCore.prompt_logprobs`), run in the worker between steps (also while paused: a
        weight sync checks it there)."""
        return await self.command(
            lambda reply: reply(self.core.prompt_logprobs(prompt_ids, top, start))
        )

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """vLLM's /sleep: hold scheduling as a pause in `mode` would (abort: the running
        requests end; wait: they finish first; keep: they stay), then release memory
        (`EngineCore.go_to_sleep`). Requests sent meanwhile wait for the wake-up."""
        assert mode in PAUSE_MODES, f"{mode=} not in {PAUSE_MODES}"

        def run(reply: Callable[[Any], None]) -> None:
            if mode == "abort":
                self.core.abort(None)

            def now() -> None:
                self.core.go_to_sleep(level)
                reply(None)

            if mode == "wait":
                self.core.when_idle(now)
                return
            now()

        await self.command(run)

    async def wake_up(self, tags: set[str] | None) -> bool:
        """vLLM's /wake_up: take back `tags` (all when None); True when fully awake."""
        return await self.command(lambda reply: reply(self.core.wake_up(tags)))

    async def set_version(self, version: str) -> None:
        """Set the reported weight version without touching the weights."""

        def run(reply: Callable[[Any], None]) -> None:
            self.core.set_version(version)
            reply(None)

        await self.command(run)
