"""The engine core: one worker thread runs the model over a continuously batched KV cache.

Routes (trio) hand sequences in with `submit` and control commands with `post`; the worker runs
them between steps, so it alone touches the model and the cache. A step decodes one token for
every running row (one forward, one batched sampling call, a few tensor ops to record it, see
`kv.py` and `rows.py`), retires finished rows at once, and fills the free slots from the bounded
waiting queue (each distinct prompt prefilled once, its KV copied to every row that asked for
it). A sequence's outputs become Python lists only when it finishes; then it goes back to trio
through its `notify` callback (the routes pass `TrioToken.run_sync_soon`), and the routes do
detokenisation and JSON there.
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
from rollouts.inference.server.rows import SlotTable
from rollouts.inference.server.sampling import SamplingSpec, sample, top_logprobs
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
    output_ids: list[int] = dataclasses.field(default_factory=list)  # set when finished
    logprobs: list[float] = dataclasses.field(default_factory=list)  # set when finished
    top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    text_len: int = 0  # length of the decoded text at the previous step (stop strings)
    stop: Stop | None = None
    weight_version: str = ""  # served when it finished
    # (version, first output token it produced): one entry, or more when the weights were
    # reloaded in place while it ran (a keep/in_place pause), so its oldest part is known
    version_starts: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    created_s: float = dataclasses.field(default_factory=time.monotonic)

    def version_spans(self) -> list[dict[str, Any]]:
        """`[{version, start, end}, ...]` over the output tokens (SGLang's and vLLM's shape)."""
        starts = self.version_starts or [(self.weight_version, 0)]
        ends = [start for _, start in starts[1:]] + [len(self.output_ids)]
        return [
            {"version": v, "start": start, "end": end}
            for (v, start), end in zip(starts, ends, strict=True)
        ]


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
        self._seqs: list[Sequence] = []  # slot i of the batch runs self._seqs[i]
        self._admitting: list[Sequence] = []  # taken from the queue, not yet in a slot
        self._kv: kvops.SlotCache | None = None
        self._table: SlotTable | None = None
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
        return len(self._seqs), len(self._waiting)

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
                with torch.inference_mode():
                    self._step()
            except Exception:
                log.exception("engine step failed; failing the running requests")
                self._fail_running()

    def _has_work(self) -> bool:
        if self._when_idle and not self._seqs:
            return True
        return not self.paused and (bool(self._seqs) or bool(self._waiting))

    def _step(self) -> None:
        if self._when_idle and not self._seqs:
            actions, self._when_idle = self._when_idle, []
            for action in actions:
                action()
        if self.paused:
            return
        if self._seqs:
            assert self._kv is not None and self._table is not None, "rows without a cache"
            batch = len(self._seqs)
            logits_B_V = kvops.decode(self.model, self._kv, self._table.last_R[:batch])
            self._retire(self._record(0, logits_B_V))
        if not self._when_idle:
            self._admit()

    def _admit(self) -> None:
        o = self.options
        with self._cv:
            n = admit_count(
                active=len(self._seqs),
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
        ready = self._admitting
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(s.prompt_ids), len(distinct)) for s in ready]
        cache, mask_U_W, logits_U_V = kvops.prefill(
            self.model, [list(p) for p in distinct], o.pad_token_id
        )
        which_N = torch.tensor(which, device=logits_U_V.device)
        kv, table = self._buffers(cache, int(mask_U_W.shape[1]), max(s.max_new for s in ready))
        first = len(self._seqs)
        kv.place(cache, mask_U_W, which_N)
        table.admit(
            [s.spec for s in ready],
            [s.max_new for s in ready],
            [s.generator is not None for s in ready],
            o.eos_token_ids,
        )
        for seq in ready:
            seq.version_starts = [(self.weight_version, 0)]
        self._seqs.extend(ready)
        self._admitting = []
        self._retire(self._record(first, logits_U_V.index_select(0, which_N)))

    def _buffers(self, like: Any, width: int, max_new: int) -> tuple[kvops.SlotCache, SlotTable]:
        """The slot cache and table, allocated at the first admission (shapes from `like`)."""
        if self._kv is None or self._table is None:
            rows = self.options.max_batch
            self._kv = kvops.SlotCache(like, rows, kvops.start_cap(width, max_new))
            self._table = SlotTable(rows, self._kv.pos_R.device)
        return self._kv, self._table

    def _record(self, first: int, logits_B_V: torch.Tensor) -> list[int]:
        """Sample the next token of slots `[first, first + B)` and record it with its logprob;
        returns the slots that finished (their `stop` is set)."""
        table = self._table
        assert table is not None, "no slot table"
        end = first + int(logits_B_V.shape[0])
        generators: dict[int, torch.Generator] = {}
        if table.seeded_R[first:end].any():
            for i in table.seeded_R[first:end].nonzero().squeeze(1).tolist():
                gen = self._seqs[first + i].generator
                assert gen is not None, f"seeded slot {first + i} has no generator"
                generators[i] = gen
        tokens_B, logprobs_B = sample(
            logits_B_V, table.sampling(first, end, generators), self.options.logprobs_from
        )
        if table.top_R[first:end].any():
            self._record_top(first, logits_B_V)
        finished = []
        for slot in table.append(first, end, tokens_B, logprobs_B):
            seq = self._seqs[slot]
            seq.stop = self._stop_now(seq, slot, int(tokens_B[slot - first]))
            if seq.stop is not None:
                finished.append(slot)
        return finished

    def _record_top(self, first: int, logits_B_V: torch.Tensor) -> None:
        rows = [i for i in range(logits_B_V.shape[0]) if self._seqs[first + i].spec.top_logprobs]
        n = max(self._seqs[first + i].spec.top_logprobs for i in rows)
        values, ids = top_logprobs(logits_B_V, n)
        for i in rows:
            k = self._seqs[first + i].spec.top_logprobs
            self._seqs[first + i].top.append(
                list(zip(values[i, :k].tolist(), ids[i, :k].tolist(), strict=True))
            )

    def _stop_now(self, seq: Sequence, slot: int, token: int) -> Stop | None:
        assert self._table is not None, "no slot table"
        text = None
        if seq.spec.stop:
            ids, _ = self._table.outputs(slot)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop = stop_after_token(
            token=token,
            num_output=int(self._table.n_out_R[slot]),
            max_new_tokens=seq.max_new,
            stop_token_ids=seq.spec.stop_token_ids,
            eos_token_ids=self.options.eos_token_ids,
            ignore_eos=seq.spec.ignore_eos,
            text=text,
            stop=seq.spec.stop,
            text_before_len=seq.text_len,
        )
        seq.text_len = len(text) if text is not None else 0
        return stop

    def _retire(self, slots: list[int]) -> None:
        """Finish the sequences in `slots` and free their slots at once."""
        for slot in slots:
            seq = self._seqs[slot]
            assert seq.stop is not None, f"{seq.rid} retired without a stop"
            self._finish_slot(slot, seq.stop)
        self._drop(slots)

    def _drop(self, slots: list[int]) -> None:
        """Free `slots`: the last active rows move into the holes, so rows stay dense."""
        if not slots:
            return
        assert self._kv is not None and self._table is not None, "no batch to shrink"
        gone = set(slots)
        batch = len(self._seqs) - len(gone)
        holes = sorted(s for s in gone if s < batch)
        movers = [s for s in range(batch, len(self._seqs)) if s not in gone]
        self._kv.move(holes, movers, batch)
        self._table.move(holes, movers, batch)
        for hole, mover in zip(holes, movers, strict=True):
            self._seqs[hole] = self._seqs[mover]
        del self._seqs[batch:]

    def _finish_slot(self, slot: int, stop: Stop) -> None:
        assert self._table is not None, "no slot table"
        seq = self._seqs[slot]
        seq.output_ids, seq.logprobs = self._table.outputs(slot)
        self._finish(seq, stop)

    def _finish(self, seq: Sequence, stop: Stop) -> None:
        seq.stop = stop
        seq.weight_version = self.weight_version
        seq.notify(seq)

    def _fail_running(self) -> None:
        failed = Stop(reason=FinishReason.ERROR)
        for slot in range(len(self._seqs)):
            try:
                self._finish_slot(slot, failed)
            except Exception:
                self._finish(self._seqs[slot], failed)
        for seq in self._admitting:
            self._finish(seq, failed)
        self._seqs, self._admitting, self._kv, self._table = [], [], None, None

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
        slots = [i for i, s in enumerate(self._seqs) if hit(s)]
        for slot in slots:
            self._finish_slot(slot, aborted)
        with torch.inference_mode():  # the cache rows it moves are inference tensors
            self._drop(slots)
        return len(gone) + len(slots)

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` once no row is running; admission stops until then."""
        self._when_idle.append(action)

    def reload(self, path: str, version: str | None) -> None:
        """Load HF safetensors weights from `path` into the model; set the version."""
        load_weights(self.model, path)
        if version is not None:
            self.set_version(version)

    def set_version(self, version: str) -> None:
        """Serve `version` from now on; running sequences note where it took over."""
        if version == self.weight_version:
            return
        self.weight_version = version
        for slot, seq in enumerate(self._seqs):
            assert self._table is not None, "running sequences without a slot table"
            seq.version_starts.append((version, int(self._table.n_out_R[slot])))

    def idle(self) -> bool:
        """No running and no waiting sequence."""
        return not self._seqs and not self._waiting
