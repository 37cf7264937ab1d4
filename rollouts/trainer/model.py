"""The module a backend trains: an HF causal LM that returns per-token logprobs, not logits.

`TokenLogprobModel.forward` runs the decoder once (in the "prefix" layout twice: the shared
prefixes, then the rows against their keys and values), gathers the hidden states that predict
each target token, and applies the LM head in chunks of `chunk_size` tokens (recomputed in the
backward pass when there are several chunks), so a large vocabulary never holds [tokens, vocab]
logits for the whole micro-batch at once. Chunk size 0 (the default) sizes chunks by the
vocabulary (512 MiB of float32 logits each), so a small vocabulary pays no recompute. An entropy
the loss does not train on (entropy_coef = 0) is computed without a graph: a metric costs no
backward pass.
The head runs only on the predictions whose target is trained (`MicroBatchTensors.head_idx`,
`training.logprob_positions = "trained"`, the default): prompt tokens cost no LM head, which on
a 49k vocabulary is a fifth of a token's compute; the other positions hold 0.
It is also the FSDP2 root module, so one forward call all-gathers everything it needs.

With a value head (a critic sharing the policy's trunk, PPO with GAE) the same forward also gives
per-token values, ALIGNED LIKE THE LOGPROBS: `values[t]` = V(tokens < t), the head applied to the
hidden state that predicts token t (the state in which token t is chosen); position 0 is 0.
The head is `value_head` on the wrapper, outside `lm`, so HF exports of `lm` never contain it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollouts.trainer.batching import MicroBatchTensors, SharedPrefix
from rollouts.trainer.logit_stats import logit_stats

# logprob_chunk_size = 0 (auto): chunks whose float32 [tokens, vocab] logits stay under this
LOGITS_CHUNK_BYTES = 512 * 2**20


def auto_chunk_size(vocab_size: int) -> int:
    """Tokens per LM-head chunk for `logprob_chunk_size = 0`: 512 MiB of float32 logits
    (tiny vocabularies: one chunk; 49k (SmolLM2): 2730 tokens; 152k (Qwen2): 883)."""
    assert vocab_size >= 1, f"{vocab_size=}"
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def _chunk_stats(
    head: nn.Module,
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    want_entropy: bool,
    entropy_grad: bool = True,
    argmax_match: bool = False,
    top_ids_N_K: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob of each target and (optionally) the entropy of its predicting distribution;
    without `entropy_grad` the entropy is a detached metric (no [N, V] graph kept for it).
    `argmax_match`: 1.0 where the target is the logits' argmax, else 0.0, in place of logprobs.
    The third: [N, K] the logprobs of `top_ids_N_K` (top-k distillation), else [N, 0]."""
    logits_N_V = head(hidden_N_H)
    if argmax_match:
        hits_N = (logits_N_V.float().argmax(dim=-1) == targets_N).float()
        return hits_N, torch.zeros_like(hits_N), hits_N.new_zeros(hits_N.shape[0], 0)
    ids_N_K = targets_N.unsqueeze(-1)
    if top_ids_N_K is not None:
        ids_N_K = torch.cat([ids_N_K, top_ids_N_K], dim=-1)
    # softmax statistics in blocks of rows, forward and backward (logit_stats.py): autograd
    # through log_softmax(logits.float()).gather walks [N, V] eight times
    lp_N_K, entropy_N = logit_stats(logits_N_V, ids_N_K, want_entropy, entropy_grad)
    return lp_N_K[:, 0], entropy_N, lp_N_K[:, 1:]


def token_stats(
    head: nn.Module,
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int,
    want_entropy: bool,
    entropy_grad: bool = True,
    argmax_match: bool = False,
    top_ids_N_K: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_chunk_stats` over chunks of `chunk_size` rows; chunks are recomputed in backward, so
    one chunk (the auto size, on a small vocabulary) costs no recompute."""
    assert hidden_N_H.shape[0] == targets_N.shape[0], f"{hidden_N_H.shape=} {targets_N.shape=}"
    assert chunk_size >= 1, f"{chunk_size=}"
    n = hidden_N_H.shape[0]
    wants = (want_entropy, entropy_grad, argmax_match)
    if n <= chunk_size:
        return _chunk_stats(head, hidden_N_H, targets_N, *wants, top_ids_N_K)
    outs = []
    for s in range(0, n, chunk_size):
        h, t = hidden_N_H[s : s + chunk_size], targets_N[s : s + chunk_size]
        top = None if top_ids_N_K is None else top_ids_N_K[s : s + chunk_size]
        args = (head, h, t, *wants, top)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            outs.append(_chunk_stats(*args))
    return tuple(torch.cat([o[i] for o in outs]) for i in range(3))  # type: ignore[return-value]


VALUE_HEAD_FILE = "value_head.pt"  # a checkpoint's critic weights (never in the HF `model/`)


def make_value_head(lm: nn.Module) -> nn.Linear:
    """A Linear(hidden, 1) critic head, zero-initialised (V = 0 until trained), on lm's device."""
    hidden = int(lm.config.hidden_size)
    param = next(lm.parameters())
    head = nn.Linear(hidden, 1, device=param.device, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class TokenLogprobModel(nn.Module):
    """Wraps an HF causal LM (`lm`) to return flat next-token logprobs (entropy, values)."""

    def __init__(self, lm: nn.Module, chunk_size: int, value_head: nn.Module | None = None) -> None:
        super().__init__()
        assert chunk_size >= 0, f"{chunk_size=}: tokens per LM-head chunk, or 0 (auto)"
        self.lm = lm
        self.chunk_size = chunk_size or auto_chunk_size(int(lm.config.vocab_size))
        self.value_head = value_head

    def forward(
        self,
        mb: MicroBatchTensors,
        want_entropy: bool = False,
        want_values: bool = False,
        entropy_grad: bool = True,
        *,
        argmax_match: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat [N] logprobs, entropies and values of every next-token prediction in `mb`, and
        [N, K] the logprobs of `mb.top_ids` ([N, 0] without them).

        Entropies are zeros unless `want_entropy` (detached unless `entropy_grad`: a metric
        only); values are empty unless `want_values`. `argmax_match` (no grad): 1.0 where the
        target is the argmax, else 0.0, in place of the logprobs (SFT's held-out accuracy).
        """
        decoder = self.lm.get_decoder()
        if mb.prefix is None:
            out = decoder(
                input_ids=mb.input_ids_R_L,
                position_ids=mb.position_ids_R_L,
                attention_mask=None,
                use_cache=False,
            )
            hidden_T_H = out.last_hidden_state.flatten(0, 1)
        else:
            hidden_T_H = self._shared_prefix_states(decoder, mb, mb.prefix)
        hidden_N_H = rows_of(hidden_T_H, mb.pred_idx)
        targets_N = mb.targets
        lp_N, ent_N, top_N_K = self._head_stats(
            mb, hidden_N_H, targets_N, (want_entropy, entropy_grad, argmax_match)
        )
        if not want_values:
            return lp_N, ent_N, lp_N.new_zeros(0), top_N_K
        if self.value_head is None:
            raise ValueError(
                "values were asked for but the backend has no value head: build it with "
                "algorithm.advantage = 'gae' (factories add the critic head then)"
            )
        values_N = self.value_head(hidden_N_H.float()).squeeze(-1).float()
        return lp_N, ent_N, values_N, top_N_K

    def _shared_prefix_states(
        self, decoder: nn.Module, mb: MicroBatchTensors, prefix: SharedPrefix
    ) -> torch.Tensor:
        """Layout "prefix": the decoder runs the prefixes, then the rows against their prefix's
        keys and values (gathered per row: the gradient sums over the rows); every state,
        flattened to [tokens, hidden], the prefixes' first."""
        from transformers import DynamicCache

        cache = DynamicCache()
        kwarg = _cache_kwarg(decoder)
        first = decoder(input_ids=prefix.ids_G_P, use_cache=True, **{kwarg: cache})
        select_cache_rows(cache, prefix.row_prefix_R)
        assert cache.get_seq_length() == prefix.ids_G_P.shape[1], f"{cache.get_seq_length()=}"
        rest = decoder(
            input_ids=mb.input_ids_R_L,
            position_ids=mb.position_ids_R_L,
            attention_mask=prefix.attention_mask_R_K,
            use_cache=True,
            **{kwarg: cache},
        )
        return torch.cat(
            [first.last_hidden_state.flatten(0, 1), rest.last_hidden_state.flatten(0, 1)]
        )

    def _head_stats(
        self,
        mb: MicroBatchTensors,
        hidden_N_H: torch.Tensor,
        targets_N: torch.Tensor,
        wants: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`token_stats` at the predictions `mb.head_idx` names (all when None); the others
        hold 0: their targets are not trained, so no loss or metric reads them. `wants`:
        (want_entropy, entropy_grad, argmax_match)."""
        head = self.lm.get_output_embeddings()
        idx, top = mb.head_idx, mb.top_ids
        if idx is None:
            return token_stats(head, hidden_N_H, targets_N, self.chunk_size, *wants, top)
        top_M = None if top is None else top[idx]
        lp_M, ent_M, top_M_K = token_stats(
            head, rows_of(hidden_N_H, idx), targets_N[idx], self.chunk_size, *wants, top_M
        )
        n = hidden_N_H.shape[0]
        lp_N = lp_M.new_zeros(n).index_copy(0, idx, lp_M)
        top_N_K = top_M_K.new_zeros(n, top_M_K.shape[1]).index_copy(0, idx, top_M_K)
        return lp_N, ent_M.new_zeros(n).index_copy(0, idx, ent_M), top_N_K


def _cache_kwarg(decoder: nn.Module) -> str:
    """The decoder's name for a KV cache: "cache" from transformers 5.24, "past_key_values"
    before (5.24 still takes the old name, with a warning)."""
    import inspect

    return (
        "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    )


def shared_prefix_problem(lm: nn.Module) -> str | None:
    """Why `training.micro_batch_layout = "prefix"` cannot run on `lm`, or None: a sliding-window
    layer keeps only its window in the cache (model.gradient_checkpointing, which would fill
    the cache again in the backward pass, is refused by the config)."""
    config = lm.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are {sorted(kinds)}; the prefix layout needs full attention in all"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return f"it attends in a sliding window ({window} tokens); the layout needs full attention"
    return None


def rows_of(x_T_H: torch.Tensor, idx_N: torch.Tensor) -> torch.Tensor:
    """`x_T_H[idx_N]`, with a gradient summed in the same order on every run: a shared prefix's
    last state predicts many rows, so `idx_N` repeats it. On CPU the backward of `x[idx]`
    (`index_put_`, accumulate) adds repeated rows with atomics across threads, in arrival order:
    same-seed float32 steps differed by an ulp. `index_select`'s (`index_add_`) adds them in
    order there, twice as fast; on a GPU it is the one with atomics, and `x[idx]` sorts."""
    if x_T_H.device.type == "cpu":
        return x_T_H.index_select(0, idx_N)
    return x_T_H[idx_N]


def select_cache_rows(cache: Any, idx_R: torch.Tensor) -> None:
    """`cache.batch_select_indices(idx_R)` (each row gets its prefix's keys and values), with
    `rows_of`'s ordered gradient: every row of a group repeats its prefix's index."""
    if not hasattr(cache, "layers"):  # transformers < 4.56 (lists of tensors): its own
        cache.batch_select_indices(idx_R)
        return
    for layer in cache.layers:
        layer.keys = rows_of(layer.keys, idx_R)
        layer.values = rows_of(layer.values, idx_R)


def split_per_sequence(flat_N: torch.Tensor, split_sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Flat predictions -> one [T_i] tensor per sequence ([T_i, K] from [N, K]), position 0
    set to 0."""
    assert flat_N.shape[0] == sum(split_sizes), f"{flat_N.shape=} != {sum(split_sizes)=}"
    zero = flat_N.new_zeros(1, *flat_N.shape[1:])
    return [torch.cat([zero, part]) for part in torch.split(flat_N, list(split_sizes))]


def move_to(mb: MicroBatchTensors, device: torch.device) -> MicroBatchTensors:
    """The same micro-batch with its tensors on `device`."""
    pos = mb.position_ids_R_L
    prefix = mb.prefix
    if prefix is not None:
        prefix = SharedPrefix(
            ids_G_P=prefix.ids_G_P.to(device, non_blocking=True),
            row_prefix_R=prefix.row_prefix_R.to(device, non_blocking=True),
            attention_mask_R_K=prefix.attention_mask_R_K.to(device, non_blocking=True),
        )
    return MicroBatchTensors(
        input_ids_R_L=mb.input_ids_R_L.to(device, non_blocking=True),
        position_ids_R_L=None if pos is None else pos.to(device, non_blocking=True),
        pred_idx=mb.pred_idx.to(device, non_blocking=True),
        targets=mb.targets.to(device, non_blocking=True),
        split_sizes=mb.split_sizes,
        head_idx=None if mb.head_idx is None else mb.head_idx.to(device, non_blocking=True),
        prefix=prefix,
        top_ids=None if mb.top_ids is None else mb.top_ids.to(device, non_blocking=True),
    )
