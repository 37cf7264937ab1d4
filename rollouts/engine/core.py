"""The engine core: one worker thread runs the model over a continuously batched KV cache.

Routes (trio) hand sequences in with `submit` and control commands with `post`; the worker runs
them between steps, so it alone touches the model and the cache. A step decodes one token for
every running row of the `RunningBatch` (`batch.py`), which retires finished rows at once, then
fills the free slots from the bounded waiting queue (a fresh batch first waits for the rest of a
burst of requests, `scheduler.keep_gathering`). A finished sequence goes back to trio through its
`notify` callback (the routes pass `TrioToken.run_sync_soon`); the routes detokenise and encode
JSON there, off the worker thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rollouts.engine import precision
from rollouts.engine.adapters import ServedAdapters
from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence
from rollouts.engine.kv import blocked_cache
from rollouts.engine.prompt_scores import PromptLogprob, score_prompt
from rollouts.engine.scheduler import (
    GATHER_GAP_S,
    BusyStats,
    Stop,
    admit_count,
    can_enqueue,
    keep_gathering,
)
from rollouts.engine.sleep import SleepState, give_back_freed, gpu_change, gpu_gib
from rollouts.engine.threads import ThreadGovernor
from rollouts.engine.weights import load_weights
from rollouts.wire.generation import FinishReason

__all__ = ["CoreOptions", "EngineCore", "PromptLogprob", "Sequence"]
log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
# The worker drops the GIL in every torch call; while the trio thread encodes answers it would
# then wait up to Python's default 5 ms switch interval to get it back, several times per step.
GIL_SWITCH_S = 0.0005


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
    decode: str = "auto"  # "auto": fast_decode (CUDA graphs on a GPU); "eager"; "hf": HF forward
    share_prefix: bool = True  # prefill the prefix new prompts share once (`kv.prefill`)
    adapt_threads: bool = False  # on CPU, probe one torch thread beside other load (threads.py)


class EngineCore:
    """Owns model, tokenizer and batch; `run` is the worker thread's body."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: CoreOptions,
        version: str,
        weights_path: str | None = None,
    ) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.weight_version = version
        # LoRA adapters by name, the last one merged in (from `weights_path`'s precise base)
        self.adapters = ServedAdapters(model, weights_path)
        self.paused = False
        self.sleep = SleepState()  # memory released by a sleep: generation waits for a wake-up
        self._cv = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._when_idle: list[Callable[[], None]] = []
        self._batch = RunningBatch(
            model,
            tokenizer,
            BatchOptions(
                max_batch=options.max_batch,
                max_prefill=options.max_prefill,
                pad_token_id=options.pad_token_id,
                eos_token_ids=options.eos_token_ids,
                logprobs_from=options.logprobs_from,
                decode=options.decode,
                share_prefix=options.share_prefix,
                cache_blocks=model is not None and blocked_cache(next(model.parameters()).device),
            ),
        )
        self._threads: ThreadGovernor | None = None  # made by the worker (`run`)
        self._admitting: list[Sequence] = []  # taken from the queue, not yet in the batch
        self._stats: BusyStats | None = None  # since the batch was last empty
        self._last_submit_s = 0.0
        self._stopped = False

    @property
    def decode_path(self) -> str:
        """Which forward the decode steps take (logged at start)."""
        return self._batch.decode_path

    # ---- called from the trio thread (thread-safe) ----
    def submit(self, seqs: list[Sequence]) -> bool:
        """Queue sequences for generation; False (nothing queued) when the queue is full."""
        with self._cv:
            if not can_enqueue(
                queued=len(self._waiting) + len(seqs) - 1, max_queue=self.options.max_queue
            ):
                return False
            was_empty = not self._waiting
            self._waiting.extend(seqs)
            self._last_submit_s = time.monotonic()
            if was_empty or len(self._waiting) >= self.options.max_batch:
                self._cv.notify()  # else the worker is busy, or gathering and wakes by itself
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
        return len(self._batch), len(self._waiting)

    # ---- the worker thread ----
    def run(self) -> None:
        """Worker loop: commands, then one scheduler step, until `stop`."""
        sys.setswitchinterval(GIL_SWITCH_S)
        self._threads = self._governor()
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
                with torch.inference_mode():
                    self._step()
            except Exception:
                log.exception("engine step failed; failing the running requests")
                self._fail_running()

    def _governor(self) -> ThreadGovernor | None:
        """A thread governor for a CPU engine of several torch threads (`threads.py`)."""
        threads = torch.get_num_threads()
        device = next(self.model.parameters()).device
        if not self.options.adapt_threads or threads <= 1 or device.type != "cpu":
            return None
        return ThreadGovernor(most=threads, set_threads=torch.set_num_threads)

    def _has_work(self) -> bool:
        if self._when_idle and not self._batch:
            return True
        return not self._held() and (bool(self._batch) or bool(self._waiting))

    def _held(self) -> bool:
        """No step runs: paused, or asleep (vLLM queues requests until fully awake)."""
        return self.paused or self.sleep.asleep

    def _step(self) -> None:
        if self._when_idle and not self._batch:
            actions, self._when_idle = self._when_idle, []
            for action in actions:
                action()
        if self._held():
            return
        if self._batch:
            start, rows = time.perf_counter(), len(self._batch)
            self._finish_all(self._batch.step())
            stats = self._busy()
            stats.steps, stats.rows = stats.steps + 1, stats.rows + rows
            took = time.perf_counter() - start
            stats.decode_s += took
            if self._threads is not None:
                self._threads.step_done(rows, took)
        if not self._when_idle:
            self._admit()
        if not self._batch and self._stats is not None:
            log.debug("%s", self._stats.summary())
            self._stats = None

    def _busy(self) -> BusyStats:
        if self._stats is None:
            self._stats = BusyStats()
        return self._stats

    def _admit(self) -> None:
        o = self.options
        with self._cv:
            if not self._batch:
                self._gather()
            n = admit_count(
                active=len(self._batch),
                waiting=len(self._waiting),
                max_batch=o.max_batch,
                max_prefill=o.max_prefill,
            )
            new = [self._waiting.popleft() for _ in range(n)]
        self._admitting = [s for s in new if s.max_new > 0]
        for seq in new:
            if seq.max_new == 0:
                self._finish(seq, Stop(reason=FinishReason.LENGTH))
        if not self._admitting:
            return
        start = time.perf_counter()
        for seq in self._admitting:
            seq.version_starts = [(self.weight_version, 0)]
        shared = self._batch.shared_tokens
        try:  # a failure while admitting fails only the sequences being admitted
            distinct, finished = self._batch.admit(self._admitting)
        except Exception:
            log.exception("admitting %d sequences failed; failing only them", len(self._admitting))
            failed, self._admitting = self._admitting, []
            for seq in failed:
                self._finish(seq, Stop(reason=FinishReason.ERROR))
            return
        stats = self._busy()
        stats.prefills, stats.prompts = stats.prefills + 1, stats.prompts + len(self._admitting)
        stats.distinct += distinct
        stats.shared += self._batch.shared_tokens - shared
        self._admitting = []
        self._finish_all(finished)
        stats.prefill_s += time.perf_counter() - start

    def _gather(self) -> None:
        """With the lock held: wait while a burst of requests is still arriving."""
        start = time.monotonic()
        while not self._inbox and not self._stopped:
            now = time.monotonic()
            if not keep_gathering(
                waiting=len(self._waiting),
                max_batch=self.options.max_batch,
                since_last_s=max(0.0, now - self._last_submit_s),
                gathered_s=now - start,
            ):
                return
            self._cv.wait(GATHER_GAP_S)

    def _finish_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.stop is not None, f"{seq.rid} finished without a stop"
            self._finish(seq, seq.stop)

    def _finish(self, seq: Sequence, stop: Stop) -> None:
        seq.stop = stop
        seq.weight_version = self.weight_version
        seq.notify(seq)

    def _fail_running(self) -> None:
        failed = Stop(reason=FinishReason.ERROR)
        taken = {id(s): s for s in [*self._batch.clear(failed), *self._admitting]}
        for seq in taken.values():  # a failed admission may have left some in both
            self._finish(seq, failed)
        self._admitting = []

    # ---- commands (run in the worker via `post`) ----
    def abort(self, rid_prefix: str | None) -> int:
        """Abort running and waiting sequences (all, or those whose rid starts with the prefix)."""
        return self.abort_where(lambda s: rid_prefix is None or s.rid.startswith(rid_prefix))

    def abort_where(self, hit: Callable[[Sequence], bool]) -> int:
        """Abort the running and waiting sequences `hit` selects; returns how many."""
        with self._cv:
            gone = [s for s in self._waiting if hit(s)]
            self._waiting = collections.deque(s for s in self._waiting if not hit(s))
        aborted = Stop(reason=FinishReason.ABORT, matched=None)
        for seq in gone:
            self._finish(seq, aborted)
        taken = self._batch.remove(hit, aborted)
        self._finish_all(taken)
        return len(gone) + len(taken)

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` once no row is running; admission stops until then."""
        self._when_idle.append(action)

    def reload(self, path: str, version: str | None) -> None:
        """Load HF safetensors weights from `path` into the model; set the version."""
        self.sleep.check_resident("reload weights")
        load_weights(self.model, path)
        self.sleep.weights_lost = False
        self.adapters.reset(path)  # the new weights are the base: the adapters' bases are gone
        self.weights_changed()
        if version is not None:
            self.set_version(version)

    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter at `path` as `name`, merged into the served weights."""
        self.sleep.check_resident("load a LoRA adapter")
        self.adapters.load(name, path)
        self.weights_changed()

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (the base weights come back if it was the merged one)."""
        active = self.adapters.active == name
        self.adapters.unload(name)
        if active:
            self.weights_changed()

    def weights_changed(self) -> None:
        """The model's weights were replaced in place: a derived LM head copy (`precision`)
        follows them, and running rows (a keep pause) are prefilled again on them before their
        next token."""
        precision.refresh(self.model)
        self._batch.weights_changed()

    def set_version(self, version: str) -> None:
        """Serve `version` from now on; running sequences note where it took over."""
        if version == self.weight_version:
            return
        self.weight_version = version
        counts = self._batch.output_counts()
        for seq, count in zip(self._batch.seqs, counts, strict=True):
            seq.version_starts.append((version, count))

    def prompt_logprobs(
        self, prompt_ids: list[int], top: int, start: int = 1
    ) -> list[PromptLogprob]:
        """Each prompt token's logprob from position `start` on under the weights being served
        (`prompt_scores`)."""
        self.sleep.check_servable("score a prompt")
        return score_prompt(self.model, prompt_ids, top, start)

    def go_to_sleep(self, level: int) -> None:
        """vLLM's sleep levels: 0 holds scheduling; 1 also moves the weights to host memory
        (already there on CPU) and drops the idle KV cache; 2 discards the weights (they come
        back as zeros on wake-up and must be reloaded before anything is served). Rows a
        `keep` sleep holds keep their KV cache, prefilled again if the weights change."""
        assert level in (0, 1, 2), f"{level=}"
        self.sleep.tags.add("scheduling")
        if level:
            self.release({"weights", "kv_cache"}, keep_weights=level == 1)

    def release(self, tags: set[str], *, keep_weights: bool) -> None:
        """Release the memory of `tags` (SGLang's /release_memory_occupation discards the
        weights, as it does without --enable-weights-cpu-backup). The KV cache goes unless rows
        are held in it (a `keep` sleep)."""
        before = gpu_gib(self.model_device())
        if "weights" in tags and "weights" not in self.sleep.tags:
            if keep_weights:
                self.sleep.offload(self.model)
            else:
                self.adapters.reset()  # their base copy goes with the weights
                self.sleep.discard(self.model)
        freed = self._batch.drop_cache() if "kv_cache" in tags else 0
        self.sleep.tags |= tags
        give_back_freed(self.model_device())
        names, gib = ",".join(sorted(tags)), freed / 2**30
        log.info(
            "released %s (KV cache %.2f GiB freed)%s",
            names,
            gib,
            gpu_change(self.model_device(), before),
        )

    def wake_up(self, tags: set[str] | None) -> bool:
        """Take back `tags` (all when None); True when fully awake (scheduling resumes)."""
        tags = set(self.sleep.tags) if tags is None else tags
        before = gpu_gib(self.model_device())
        if "weights" in tags and "weights" in self.sleep.tags:
            self.sleep.restore(self.model, self.model_device())
        self.sleep.tags -= tags
        if before is not None:
            log.info(
                "awake (tags %s)%s", ",".join(sorted(tags)), gpu_change(self.model_device(), before)
            )
        return not self.sleep.asleep

    def model_device(self) -> torch.device:
        return self.sleep.device or next(self.model.parameters()).device

    def idle(self) -> bool:
        """No running and no waiting sequence."""
        return not self._batch and not self._waiting
