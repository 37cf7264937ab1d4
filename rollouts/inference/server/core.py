"""The engine core: one worker thread runs the model over a continuously batched KV cache.

Routes (trio) hand sequences in with `submit` and control commands with `post`; the worker runs
them between steps, so it alone touches the model and the cache. A step decodes one token for
every running row, retires finished rows at once, and fills the free slots from the bounded
waiting queue (prefilled together, merged into the shared cache). Results go back to trio through
each sequence's `notify` callback (the routes pass `TrioToken.run_sync_soon`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rollouts.inference.protocol import FinishReason
from rollouts.inference.server import kv as kvops
from rollouts.inference.server.sampling import SamplingSpec, choose_tokens, top_logprobs
from rollouts.inference.server.scheduler import Stop, admit_count, can_enqueue, stop_after_token
from rollouts.inference.server.weights import load_weights

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    """One sequence being generated; the worker fills the outputs, then calls `notify`."""

    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_new: int  # max_new_tokens capped by the context length
    notify: Callable[[Sequence], None]
    generator: torch.Generator | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    text_len: int = 0  # length of the decoded text at the previous step (stop strings)
    stop: Stop | None = None
    weight_version: str = ""
    created_s: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CoreOptions:
    """Limits and behaviour of the core."""

    max_batch: int = 64
    max_queue: int = 1024
    max_prefill: int = 64
    logprobs_from: str = "raw"
    context_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


class EngineCore:
    """Owns model, tokenizer and batch; `run` is the worker thread's body."""

    def __init__(self, model: Any, tokenizer: Any, options: CoreOptions, version: str) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.weight_version = version
        self.paused = False
        self._cv = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._when_idle: list[Callable[[], None]] = []
        self._rows: list[Sequence] = []
        self._kv: kvops.BatchKV | None = None
        self._last_B: torch.Tensor | None = None
        self._stopped = False

    # ---- called from the trio thread (thread-safe) ----
    def submit(self, seqs: list[Sequence]) -> bool:
        """Queue sequences for generation; False (nothing queued) when the queue is full."""
        with self._cv:
            if not can_enqueue(
                queued=len(self._waiting) + len(seqs) - 1, max_queue=self.options.max_queue
            ):
                return False
            self._waiting.extend(seqs)
            self._cv.notify()
        return True

    def post(self, command: Callable[[], None]) -> None:
        """Run `command` in the worker thread before its next step."""
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    def stop(self) -> None:
        """Make `run` return."""
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting) counts, read without stopping the worker."""
        return len(self._rows), len(self._waiting)

    # ---- the worker thread ----
    def run(self) -> None:
        """Worker loop: commands, then one scheduler step, until `stop`."""
        while True:
            with self._cv:
                if not self._inbox and not self._stopped and not self._has_work():
                    self._cv.wait(IDLE_WAIT_S)
                commands = list(self._inbox)
                self._inbox.clear()
                if self._stopped:
                    return
            for command in commands:
                command()
            try:
                self._step()
            except Exception:
                log.exception("engine step failed; failing the running requests")
                self._fail_running()

    def _has_work(self) -> bool:
        if self._when_idle and not self._rows:
            return True
        return not self.paused and (bool(self._rows) or bool(self._waiting))

    def _step(self) -> None:
        if self._when_idle and not self._rows:
            actions, self._when_idle = self._when_idle, []
            for action in actions:
                action()
        if self.paused:
            return
        if self._rows:
            assert self._kv is not None and self._last_B is not None, "rows without a cache"
            logits_B_V = kvops.decode(self.model, self._kv, self._last_B)
            self._last_B = self._record(self._rows, logits_B_V)
            self._retire()
        if not self._when_idle:
            self._admit()

    def _admit(self) -> None:
        o = self.options
        with self._cv:
            n = admit_count(
                active=len(self._rows),
                waiting=len(self._waiting),
                max_batch=o.max_batch,
                max_prefill=o.max_prefill,
            )
            new = [self._waiting.popleft() for _ in range(n)]
        ready = []
        for seq in new:
            if seq.max_new == 0:
                self._finish(seq, Stop(reason=FinishReason.LENGTH))
            else:
                ready.append(seq)
        if not ready:
            return
        kv_new, logits_B_V = kvops.prefill(
            self.model, [s.prompt_ids for s in ready], o.pad_token_id
        )
        tokens_B = self._record(ready, logits_B_V)
        if self._kv is None:
            self._kv, self._last_B, self._rows = kv_new, tokens_B, ready
        else:
            assert self._last_B is not None, "a cache without last tokens"
            self._kv = kvops.merge(self._kv, kv_new)
            self._last_B = torch.cat([self._last_B, tokens_B])
            self._rows = self._rows + ready
        self._retire()

    def _record(self, seqs: list[Sequence], logits_B_V: torch.Tensor) -> torch.Tensor:
        """Choose each row's next token, append it with its logprob, and decide whether it stops."""
        specs = [s.spec for s in seqs]
        tokens_B, logprobs_B = choose_tokens(
            logits_B_V, specs, [s.generator for s in seqs], self.options.logprobs_from
        )
        top_n = max(s.top_logprobs for s in specs)
        tops = top_logprobs(logits_B_V, top_n) if top_n else None
        for i, seq in enumerate(seqs):
            token = int(tokens_B[i])
            seq.output_ids.append(token)
            seq.logprobs.append(float(logprobs_B[i]))
            if tops is not None and seq.spec.top_logprobs:
                k = seq.spec.top_logprobs
                seq.top.append(
                    list(zip(tops[0][i, :k].tolist(), tops[1][i, :k].tolist(), strict=True))
                )
            text = None
            if seq.spec.stop:
                text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=False)
            seq.stop = stop_after_token(
                token=token,
                num_output=len(seq.output_ids),
                max_new_tokens=seq.max_new,
                stop_token_ids=seq.spec.stop_token_ids,
                eos_token_ids=self.options.eos_token_ids,
                ignore_eos=seq.spec.ignore_eos,
                text=text,
                stop=seq.spec.stop,
                text_before_len=seq.text_len,
            )
            seq.text_len = len(text) if text is not None else 0
        return tokens_B

    def _retire(self) -> None:
        """Drop finished rows from the batch at once, freeing their slots."""
        keep = [i for i, s in enumerate(self._rows) if s.stop is None]
        if len(keep) == len(self._rows):
            return
        for seq in self._rows:
            if seq.stop is not None:
                self._finish(seq, seq.stop)
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        assert self._kv is not None and self._last_B is not None, "no batch to shrink"
        self._rows = [self._rows[i] for i in keep]
        self._kv = kvops.keep_rows(self._kv, keep)
        self._last_B = self._last_B[keep] if keep else None

    def _finish(self, seq: Sequence, stop: Stop) -> None:
        seq.stop = stop
        seq.weight_version = self.weight_version
        seq.notify(seq)

    def _fail_running(self) -> None:
        for seq in self._rows:
            self._finish(seq, Stop(reason=FinishReason.ERROR))
        self._rows, self._kv, self._last_B = [], None, None

    # ---- commands (run in the worker via `post`) ----
    def abort(self, rid_prefix: str | None) -> int:
        """Abort running and waiting sequences (all, or those whose rid starts with the prefix)."""

        def hit(seq: Sequence) -> bool:
            return rid_prefix is None or seq.rid.startswith(rid_prefix)

        with self._cv:
            gone = [s for s in self._waiting if hit(s)]
            self._waiting = collections.deque(s for s in self._waiting if not hit(s))
        aborted = Stop(reason=FinishReason.ABORT, matched=None)
        for seq in gone:
            self._finish(seq, aborted)
        keep = [i for i, s in enumerate(self._rows) if not hit(s)]
        for seq in self._rows:
            if hit(seq):
                self._finish(seq, aborted)
        count = len(gone) + len(self._rows) - len(keep)
        if len(keep) != len(self._rows):
            self._keep(keep)
        return count

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` once no row is running; admission stops until then."""
        self._when_idle.append(action)

    def reload(self, path: str, version: str | None) -> None:
        """Load HF safetensors weights from `path` into the model; set the version."""
        load_weights(self.model, path)
        if version is not None:
            self.weight_version = version

    def idle(self) -> bool:
        """No running and no waiting sequence."""
        return not self._rows and not self._waiting
