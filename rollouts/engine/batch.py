"""The running batch: the sequences in the decode slots, their KV cache and per-slot state.

Used by the worker thread only. `admit` prefills new sequences (each distinct prompt once, its KV
copied to every slot that asked for it; the prefix the prompts share once, `kv.SharedPrefix`)
and samples their first token; `step` decodes one token
for every slot (one forward, one batched sampling call, a few tensor ops to record it);
finished sequences leave at once and the last slots move into the holes, so the active slots
stay dense. Outputs become Python lists only for sequences that leave (`output_ids`,
`logprobs`); the caller then sets their version and notifies them. After the weights change
under running rows (a reload in a keep pause), `weights_changed` makes the next step prefill
every row again over its tokens so far, so no later token reads the old weights' KV cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from rollouts.engine import fast_decode, graphs, precision
from rollouts.engine import kv as kvops
from rollouts.engine.rows import SlotTable
from rollouts.engine.sampling import SamplingSpec, sample, top_logprobs
from rollouts.engine.scheduler import Stop, stop_after_token


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    """One sequence being generated; the worker fills the outputs, then calls `notify`."""

    rid: str  # this sequence's id (`<request>-<i>` for sample i of n > 1)
    prompt_ids: list[int]
    spec: SamplingSpec
    max_new: int  # max_new_tokens capped by the context length
    notify: Callable[[Sequence], None]
    seed: int | None = None  # its sampling seed (`sampling.seeded_uniforms`); None: global RNG
    output_ids: list[int] = dataclasses.field(default_factory=list)  # set when it leaves
    logprobs: list[float] = dataclasses.field(default_factory=list)  # set when it leaves
    top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    # stop strings only: the output decoded so far, built a few tokens at a time (the tokens
    # from `text_prefix` on are decoded again each step, those from `text_read` on are new)
    text: str = ""
    text_prefix: int = 0
    text_read: int = 0
    stop: Stop | None = None
    weight_version: str = ""  # served when it finished
    # (version, first output token it produced): one entry, or more when the weights were
    # reloaded in place while it ran (a keep/in_place pause), so its oldest part is known
    version_starts: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    created_s: float = dataclasses.field(default_factory=time.monotonic)
    request: str = ""  # the id of the request (prompt) it belongs to: vLLM aborts by it

    def version_spans(self) -> list[dict[str, Any]]:
        """`[{version, start, end}, ...]` over the output tokens (SGLang's and vLLM's shape)."""
        starts = self.version_starts or [(self.weight_version, 0)]
        ends = [start for _, start in starts[1:]] + [len(self.output_ids)]
        return [
            {"version": v, "start": start, "end": end}
            for (v, start), end in zip(starts, ends, strict=True)
        ]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BatchOptions:
    """What the running batch needs to know about the model and the requests' defaults."""

    max_batch: int
    max_prefill: int  # rows prefilled in one forward when the running rows are prefilled again
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    logprobs_from: str
    # "auto": fast_decode where the model is supported, in CUDA graphs on a GPU; "eager": the
    # same without graphs; "hf": the HF forward always
    decode: str = "auto"
    # prefill the prefix new prompts share once, and keep it for the next admission (`kv.prefill`)
    share_prefix: bool = True
    # the KV cache in column blocks (`kv.blocked_cache`: an engine on one CPU thread)
    cache_blocks: bool = False


class RunningBatch:
    """Slot i decodes `seqs[i]`; the cache and the table are allocated at the first admission."""

    def __init__(self, model: Any, tokenizer: Any, options: BatchOptions) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.seqs: list[Sequence] = []
        self._kv: kvops.SlotCache | None = None
        self._table: SlotTable | None = None
        self._stale = False  # the running rows' KV cache is from weights no longer loaded
        # the prompts' shared prefix under the weights loaded now (cleared when they change)
        self._shared = kvops.SharedPrefix() if options.share_prefix else None
        why = fast_decode.unsupported(model) if options.decode != "hf" else "--decode hf"
        # the decode step: the engine's own for Llama-family models, else the HF forward; on
        # CUDA its captured graphs ("auto"), or its kernels launched one by one ("eager")
        self._decode_step: Callable[..., torch.Tensor] | None = None
        self.decode_path = f"HF forward ({why})"
        if not why:
            self._decode_step = fast_decode.decode
            self.decode_path = f"fast ({type(model).__name__})"
            on_cuda = next(model.parameters()).device.type == "cuda"
            if options.decode == "auto" and on_cuda:
                self._decode_step = graphs.StepGraphs(options.max_batch)
                self.decode_path += ", CUDA graphs"

    def __len__(self) -> int:
        return len(self.seqs)

    def admit(self, ready: list[Sequence]) -> tuple[int, list[Sequence]]:
        """Prefill `ready` into free slots and sample their first token.

        Returns (distinct prompts prefilled, sequences that already finished)."""
        assert ready, "nothing to admit"
        assert len(self.seqs) + len(ready) <= self.options.max_batch, f"{len(ready)=}"
        if self._stale:
            self._prefill_again()
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(s.prompt_ids), len(distinct)) for s in ready]
        cache, mask_U_W, logits_U_V = kvops.prefill(
            self.model, [list(p) for p in distinct], self.options.pad_token_id, self._shared
        )
        which_N = torch.tensor(which, device=logits_U_V.device)
        if self._kv is None or self._table is None:
            cap = kvops.start_cap(int(mask_U_W.shape[1]), max(s.max_new for s in ready))
            dtype = precision.cache_dtype(self.model, cache.layers[0].keys.dtype)
            self._kv = kvops.SlotCache(
                cache, self.options.max_batch, cap, dtype, blocked=self.options.cache_blocks
            )
            self._table = SlotTable(self.options.max_batch, self._kv.pos_R.device)
        first = len(self.seqs)
        try:
            self._kv.place(cache, mask_U_W, which_N)
            self._table.admit(
                [s.spec for s in ready],
                [s.max_new for s in ready],
                [s.seed for s in ready],
                self.options.eos_token_ids,
            )
            self.seqs.extend(ready)
            finished = self._record(first, logits_U_V[which_N])
        except Exception:  # the running slots stay as they were; the caller fails `ready`
            del self.seqs[first:]
            self._kv.move([], [], first)
            self._table.move([], [], first)
            raise
        return len(distinct), self._leave(finished)

    def step(self) -> list[Sequence]:
        """Decode one token for every slot; returns the sequences that finished."""
        assert self._kv is not None and self._table is not None, "a step without a batch"
        if self._stale:
            self._prefill_again()
        last_B = self._table.last_R[: len(self.seqs)]
        logits_B_V = kvops.decode(self.model, self._kv, last_B, self._decode_step)
        return self._leave(self._record(0, logits_B_V))

    def weights_changed(self) -> None:
        """The model's weights were replaced in place: the running rows' KV cache is the old
        weights', so it is rebuilt before the next token (as SGLang re-prefills the requests a
        retract pause took out)."""
        self._stale = bool(self.seqs)
        if self._shared is not None:
            self._shared.clear()

    @property
    def shared_tokens(self) -> int:
        """Prompt tokens not prefilled thanks to a shared prefix, since the start."""
        return 0 if self._shared is None else self._shared.saved

    def _prefill_again(self) -> None:
        """Rebuild every running row's KV cache with the weights loaded now, from its prompt and
        its output but the last token (the next decode input, as after `admit`), `max_prefill`
        rows per forward. Nothing is sampled: outputs and sampling state stay."""
        kv, table = self._kv, self._table
        if not self.seqs or kv is None or table is None:
            self._stale = False
            return
        counts = self.output_counts()
        assert min(counts) >= 1, f"{counts=}: a running row without its first token"
        rows = [
            seq.prompt_ids + table.tok_R_W[slot, : n - 1].tolist()
            for slot, (seq, n) in enumerate(zip(self.seqs, counts, strict=True))
        ]
        kv.move([], [], 0)  # empty: the rows are placed again in slot order
        step = self.options.max_prefill
        for first in range(0, len(rows), step):
            distinct: dict[tuple[int, ...], int] = {}
            which = [
                distinct.setdefault(tuple(r), len(distinct)) for r in rows[first : first + step]
            ]
            cache, mask_U_W, _ = kvops.prefill(
                self.model, [list(r) for r in distinct], self.options.pad_token_id
            )
            kv.place(cache, mask_U_W, torch.tensor(which, device=mask_U_W.device))
        assert kv.batch == len(self.seqs), f"{kv.batch=} != {len(self.seqs)=}"
        self._stale = False

    def output_counts(self) -> list[int]:
        """How many tokens each running sequence has produced so far (slot order)."""
        if self._table is None:
            return [0] * len(self.seqs)
        return self._table.n_out_R[: len(self.seqs)].tolist()

    def remove(self, hit: Callable[[Sequence], bool], stop: Stop) -> list[Sequence]:
        """Take out the sequences `hit` selects (their output so far, `stop` set)."""
        slots = [i for i, s in enumerate(self.seqs) if hit(s)]
        for slot in slots:
            self.seqs[slot].stop = stop
        with torch.inference_mode():  # called from commands; the cache rows it moves are such
            return self._leave(slots)

    def cache_bytes(self) -> int:
        """Bytes of the KV cache buffers (kept at their size while no row runs)."""
        if self._kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self._kv.keys, *self._kv.values))

    def drop_cache(self) -> int:
        """Free the KV cache when no row runs (a sleep's "kv_cache"); the bytes freed. Rows held
        by a `keep` sleep keep theirs."""
        if self.seqs:
            return 0
        freed = self.cache_bytes()
        self._kv = self._table = None
        if self._shared is not None:
            self._shared.clear()
        return freed

    def clear(self, stop: Stop) -> list[Sequence]:
        """Take out every sequence (after a failed step: the buffers are dropped too)."""
        gone, table = self.seqs, self._table
        for slot, seq in enumerate(gone):
            seq.stop = stop
            if table is not None and slot < table.batch:
                seq.output_ids, seq.logprobs = table.outputs(slot)
        self.seqs, self._kv, self._table = [], None, None
        if self._shared is not None:
            self._shared.clear()
        return gone

    def _record(self, first: int, logits_B_V: torch.Tensor) -> list[int]:
        """Sample the next token of slots `[first, first + B)` and record it with its logprob;
        returns the slots that finished (their `stop` is set)."""
        table = self._table
        assert table is not None, "no slot table"
        end = first + int(logits_B_V.shape[0])
        tokens_B, logprobs_B = sample(
            logits_B_V, table.sampling(first, end), self.options.logprobs_from
        )
        if table.any_top(first, end):
            self._record_top(first, logits_B_V)
        finished = []
        for slot, token, n_out in table.append(first, end, tokens_B, logprobs_B):
            seq = self.seqs[slot]
            seq.stop = self._stop_now(seq, slot, token, n_out)
            if seq.stop is not None:
                finished.append(slot)
        return finished

    def _record_top(self, first: int, logits_B_V: torch.Tensor) -> None:
        rows = [i for i in range(logits_B_V.shape[0]) if self.seqs[first + i].spec.top_logprobs]
        n = max(self.seqs[first + i].spec.top_logprobs for i in rows)
        values, ids = top_logprobs(logits_B_V, n)
        for i in rows:
            k = self.seqs[first + i].spec.top_logprobs
            self.seqs[first + i].top.append(
                list(zip(values[i, :k].tolist(), ids[i, :k].tolist(), strict=True))
            )

    def _stop_now(self, seq: Sequence, slot: int, token: int, n_out: int) -> Stop | None:
        before = len(seq.text)
        if seq.spec.stop:
            self._detokenize(seq, slot, n_out)
        return stop_after_token(
            token=token,
            num_output=n_out,
            max_new_tokens=seq.max_new,
            stop_token_ids=seq.spec.stop_token_ids,
            eos_token_ids=self.options.eos_token_ids,
            ignore_eos=seq.spec.ignore_eos,
            text=seq.text if seq.spec.stop else None,
            stop=seq.spec.stop,
            text_before_len=before,
        )

    def _detokenize(self, seq: Sequence, slot: int, n: int) -> None:
        """Extend `seq.text` incrementally (not the whole output each step): decode the tokens
        from `text_prefix` with and without the unread ones and keep the difference, once it
        does not end inside a character; context before the read point keeps spacing right."""
        assert self._table is not None, "no slot table"
        ids = self._table.tok_R_W[slot, seq.text_prefix : n].tolist()
        read = seq.text_read - seq.text_prefix
        old = self.tokenizer.decode(ids[:read], skip_special_tokens=False)
        new = self.tokenizer.decode(ids, skip_special_tokens=False)
        if len(new) > len(old) and not new.endswith("\ufffd"):
            seq.text += new[len(old) :]
            seq.text_prefix, seq.text_read = seq.text_read, n

    def _leave(self, slots: list[int]) -> list[Sequence]:
        """Sequences in `slots` leave (outputs as lists); the last active slots fill the holes."""
        if not slots:
            return []
        assert self._kv is not None and self._table is not None, "no batch to shrink"
        gone = [self.seqs[s] for s in slots]
        for slot, seq in zip(slots, gone, strict=True):
            assert seq.stop is not None, f"{seq.rid} leaves without a stop"
            seq.output_ids, seq.logprobs = self._table.outputs(slot)
        dropped = set(slots)
        batch = len(self.seqs) - len(dropped)
        holes = sorted(s for s in dropped if s < batch)
        movers = [s for s in range(batch, len(self.seqs)) if s not in dropped]
        self._kv.move(holes, movers, batch)
        self._table.move(holes, movers, batch)
        for hole, mover in zip(holes, movers, strict=True):
            self.seqs[hole] = self.seqs[mover]
        del self.seqs[batch:]
        return gone
