"""Per-request sampling seeds: what makes two runs with the same `run.seed` sample alike.

Each engine request carries a seed derived from the run's seed, the batch it belongs to (the RL
step's batch number) and the sample: its group (`Sample.group_index`, unique in a run and kept
in the DataBuffer's checkpoint), its place in the group, and how many response tokens it
already holds (a resumed partial rollout continues from there; a fresh one holds none). None of
these depend on timing or on which engine serves the request, so a resumed run sends the same
seeds as an uninterrupted one. Every engine kind takes them (the built-in server and SGLang as
`sampling_seed`, vLLM as `seed`); what the engine does with them is its own (see `docs/`).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # non-negative and inside int64: what SGLang, vLLM and torch.Generator all take


def request_seed(
    run_seed: int, batch: int, group_index: int, sample_index: int, tokens_so_far: int
) -> int:
    """The sampling seed of one request: a hash of where it sits in the run, in [0, 2**63)."""
    assert batch >= 0, f"{batch=} must be >= 0"
    assert group_index >= 0 and sample_index >= 0, f"{group_index=} {sample_index=}"
    assert tokens_so_far >= 0, f"{tokens_so_far=} must be >= 0"
    key = f"rollouts-seed/{run_seed}/{batch}/{group_index}/{sample_index}/{tokens_so_far}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)
