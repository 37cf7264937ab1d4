"""Per-slot state of the running batch as tensors: sampling parameters, stop ids, outputs.

Slot i holds the sequence in slot i of the KV cache (`kv.SlotCache`); both move rows the same
way. Per decode step the core makes a handful of tensor calls here for the whole batch (append
the sampled tokens and logprobs, flag the rows that hit a stop token or their length); Python
lists of output ids and logprobs are built only when a sequence finishes. What the step must
branch on (is any row greedy, filtered, seeded, asking for top logprobs) is kept on the host as
well, so a step reads the device once (the rows that may stop), not once per question: on a GPU
each read waits for every kernel queued before it.
"""

from __future__ import annotations

import torch

from rollouts.engine.sampling import BatchSampling, SamplingSpec, needs_filter, seed_as_int64


class SlotTable:
    """Sampling parameters, stop token ids, output buffers and next input token of each slot."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows, self.batch, self.device = rows, 0, device

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(rows, dtype=dtype, device=device)

        self.temp_R, self.top_p_R, self.min_p_R = (zeros(torch.float32) for _ in range(3))
        self.top_k_R, self.max_new_R, self.n_out_R, self.last_R = (
            zeros(torch.long) for _ in range(4)
        )
        self.greedy_R, self.strings_R, self.seeded_R = (zeros(torch.bool) for _ in range(3))
        self.seed_R = zeros(torch.long)  # a seeded slot's seed (`seed_as_int64`)
        # host copies of the per-slot flags a step branches on, slot order
        self.greedy: list[bool] = []
        self.filtered: list[bool] = []
        self.seeded: list[bool] = []
        self.top: list[bool] = []
        self.stop_R_K = torch.full((rows, 1), -1, dtype=torch.long, device=device)
        self.tok_R_W = torch.zeros((rows, 0), dtype=torch.long, device=device)
        self.lp_R_W = torch.zeros((rows, 0), dtype=torch.float32, device=device)
        self.arange_R = torch.arange(rows, device=device)

    def admit(
        self,
        specs: list[SamplingSpec],
        max_new: list[int],
        seeds: list[int | None],
        eos: tuple[int, ...],
    ) -> None:
        """Fill slots `[batch, batch + len(specs))` for new sequences (nothing output yet);
        `seeds`: each one's sampling seed, None for one drawing from the global RNG."""
        n = len(specs)
        assert self.batch + n <= self.rows, f"{self.batch=} + {n=} > {self.rows=}"
        assert len(max_new) == n, f"{len(max_new)=} != {n=}"
        rows = slice(self.batch, self.batch + n)

        def put(buf: torch.Tensor, values: list) -> None:
            buf[rows] = torch.tensor(values, dtype=buf.dtype, device=self.device)

        put(self.temp_R, [s.temperature for s in specs])
        put(self.top_p_R, [s.top_p for s in specs])
        put(self.min_p_R, [s.min_p for s in specs])
        put(self.top_k_R, [s.top_k for s in specs])
        put(self.max_new_R, max_new)
        put(self.greedy_R, [s.greedy for s in specs])
        put(self.strings_R, [bool(s.stop) for s in specs])
        put(self.seeded_R, [seed is not None for seed in seeds])
        put(self.seed_R, [0 if seed is None else seed_as_int64(seed) for seed in seeds])
        assert len(self.greedy) == self.batch, f"{len(self.greedy)=} != {self.batch=}"
        self.greedy += [s.greedy for s in specs]
        self.filtered += [needs_filter(s) for s in specs]
        self.seeded += [seed is not None for seed in seeds]
        self.top += [s.top_logprobs > 0 for s in specs]
        self.n_out_R[rows] = 0
        stops = [list(s.stop_token_ids) + ([] if s.ignore_eos else list(eos)) for s in specs]
        self._grow(max(max(max_new), 1), max(max(len(s) for s in stops), 1))
        padded = [s + [-1] * (self.stop_R_K.shape[1] - len(s)) for s in stops]
        put(self.stop_R_K, padded)
        self.batch += n

    def _grow(self, width: int, stops: int) -> None:
        if width > self.tok_R_W.shape[1]:
            width = max(width, 2 * self.tok_R_W.shape[1])
            self.tok_R_W = _wider(self.tok_R_W, width, 0)
            self.lp_R_W = _wider(self.lp_R_W, width, 0.0)
        if stops > self.stop_R_K.shape[1]:
            self.stop_R_K = _wider(self.stop_R_K, stops, -1)

    def sampling(self, a: int, b: int) -> BatchSampling:
        """The BatchSampling of slots `[a, b)`, for the next token of each."""
        greedy, seeded = self.greedy[a:b], self.seeded[a:b]
        return BatchSampling(
            temp_B=self.temp_R[a:b],
            top_k_B=self.top_k_R[a:b],
            top_p_B=self.top_p_R[a:b],
            min_p_B=self.min_p_R[a:b],
            greedy_B=self.greedy_R[a:b],
            filtered=any(self.filtered[a:b]),
            greedy=any(greedy),
            sampled=not all(greedy),
            seed_B=self.seed_R[a:b],
            draw_B=self.n_out_R[a:b],
            seeded_B=self.seeded_R[a:b],
            seeded=any(seeded),
            unseeded=not all(seeded),
        )

    def any_top(self, a: int, b: int) -> bool:
        """Whether a slot of `[a, b)` asked for top logprobs."""
        return any(self.top[a:b])

    def append(
        self, a: int, b: int, tokens_B: torch.Tensor, logprobs_B: torch.Tensor
    ) -> list[tuple[int, int, int]]:
        """Record one token per slot of `[a, b)`; `(slot, token, tokens out)` of the slots
        (absolute) that may stop now: a stop token id or EOS was produced, the length is
        reached, or the row has stop strings. One read of the device for the whole batch."""
        assert tokens_B.shape == (b - a,), f"{tokens_B.shape=} {a=} {b=}"
        n_B = self.n_out_R[a:b]
        self.tok_R_W[self.arange_R[a:b], n_B] = tokens_B
        self.lp_R_W[self.arange_R[a:b], n_B] = logprobs_B.float()
        n_B += 1
        self.last_R[a:b] = tokens_B
        hit_B = (self.stop_R_K[a:b] == tokens_B.unsqueeze(1)).any(dim=1)
        maybe_B = hit_B | (n_B >= self.max_new_R[a:b]) | self.strings_R[a:b]
        maybe, tokens, counts = torch.stack((maybe_B.long(), tokens_B, n_B)).tolist()
        return [(a + i, tokens[i], counts[i]) for i, flag in enumerate(maybe) if flag]

    def outputs(self, slot: int) -> tuple[list[int], list[float]]:
        """Output ids and logprobs of `slot` so far, as Python lists."""
        n = int(self.n_out_R[slot])
        return self.tok_R_W[slot, :n].tolist(), self.lp_R_W[slot, :n].tolist()

    def move(self, dst: list[int], src: list[int], batch: int) -> None:
        """Copy slots `src` into `dst` (same order) and keep only `[0, batch)` active."""
        assert len(dst) == len(src), f"{len(dst)=} != {len(src)=}"
        if dst:
            d = torch.tensor(dst, device=self.device)
            s = torch.tensor(src, device=self.device)
            for buf in self._buffers():
                buf[d] = buf[s]
        for flags in (self.greedy, self.filtered, self.seeded, self.top):
            for hole, mover in zip(dst, src, strict=True):
                flags[hole] = flags[mover]
            del flags[batch:]
        self.batch = batch

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (
            self.temp_R,
            self.top_p_R,
            self.min_p_R,
            self.top_k_R,
            self.max_new_R,
            self.n_out_R,
            self.last_R,
            self.greedy_R,
            self.strings_R,
            self.seeded_R,
            self.seed_R,
            self.stop_R_K,
            self.tok_R_W,
            self.lp_R_W,
        )


def _wider(buf: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    out = buf.new_full((buf.shape[0], width), fill)
    out[:, : buf.shape[1]] = buf
    return out
