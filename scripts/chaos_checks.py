"""The equality checks of `scripts/chaos.py`: a run broken by faults against an unbroken one.

Each check is a pure function of the two runs' files and returns a `Check` (its name, whether it
held, and what differed). Keys left out of the metrics comparison, by name:
- timings and rates (`time/*`, `perf/*`, `memory/*`, any key with an `_s` unit, `engines/load`),
  as in `scripts/same_seed.py`;
- `train/logprob_mismatch` is compared to 1e-4, and its largest gap reported: the engine's
  floats depend on the batch a row ran in and on the engine's history (its cache's size, a
  restart), which faults change; with the demo's bf16 engine the gap reached 2.5e-5 (1.4%) on
  one step of 60, ~1e-6 on most (it only measures the engine; training takes its own logprobs);
- `sync/attempts`, `sync/failed_engines`, `sync/engines_down`: what a sync met (an engine killed
  or stopped), reported when they differ but not a failure;
- every `sync/*` key absent from the broken run's line of a step whose weight sync failed: the
  run stopped there after its rescue checkpoint, whose line (written again on resume) holds the
  step's metrics up to the sync; reported, not a failure;
- any `sync/*` key of a step whose sync met a dead engine (`sync/failed_engines` > 0): the sync
  measured only the engines it reached (`sync/content_gap_max` reads 0.0 when it reached none;
  the engine that came back proved the weights through the health check); reported.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

BATCH_FLOATS = {"train/logprob_mismatch": 1e-4}
FAULT_KEYS = frozenset({"sync/attempts", "sync/failed_engines", "sync/engines_down"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One check's outcome: `ok`, and a line saying what was compared or what differed."""

    name: str
    ok: bool
    detail: str


def is_timing(key: str) -> bool:
    """A key whose value is a time, a rate or a load (never equal between two runs)."""
    return (
        key.startswith(("time/", "perf/", "memory/"))
        or re.search(r"_s(_|$)", key) is not None
        or key == "engines/load"
    )


def read_lines(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a JSONL file and its problems (a torn line, one that does not parse)."""
    data = path.read_bytes() if path.exists() else b""
    problems = []
    if data and not data.endswith(b"\n"):
        problems.append(f"{path.name}: the last line is torn (no newline)")
    rows = []
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            problems.append(f"{path.name}:{number}: not JSON: {line[:80]!r}")
    return rows, problems


def check_metrics_whole(run: Path, steps: int) -> Check:
    """metrics.jsonl: every line whole, each step once and in order, up to `steps`."""
    rows, problems = read_lines(run / "metrics.jsonl")
    logged = [int(r["step"]) for r in rows]
    first = logged[0] if logged else 0
    expected = list(range(first, steps + 1))
    if logged != expected:
        dup = [s for s, n in collections.Counter(logged).items() if n > 1]
        problems.append(f"steps {_ranges(logged)} != {_ranges(expected)} (repeated: {dup})")
    detail = "; ".join(problems) or f"{len(rows)} whole lines, steps {first}..{steps} once each"
    return Check(name="metrics.jsonl whole", ok=not problems, detail=detail)


def check_metrics_equal(clean: Path, chaos: Path) -> tuple[Check, Check]:
    """Each step's metrics equal the unbroken run's (timings left out); and the fault-dependent
    keys, reported apart."""
    a, _ = read_lines(clean / "metrics.jsonl")
    b, _ = read_lines(chaos / "metrics.jsonl")
    by_step = {int(r["step"]): r for r in b}
    differ: dict[str, tuple[int, Any, Any]] = {}
    fault: dict[str, int] = collections.Counter()
    unsynced: set[int] = set()  # steps whose sync failed in the broken run
    gaps: dict[str, float] = {}  # the engine's floats: the largest gap within tolerance
    for row in a:
        other = by_step.get(int(row["step"]), {})
        for key in sorted(row.keys() | other.keys()):
            va, vb = row.get(key), other.get(key)
            if va == vb or is_timing(key):
                continue
            if key in FAULT_KEYS:
                fault[key] += 1
            elif key.startswith("sync/") and key not in other and _sync_failed(row, other):
                unsynced.add(int(row["step"]))
            elif key.startswith("sync/") and other.get("sync/failed_engines", 0) > 0:
                fault[f"{key} (the sync met a dead engine)"] += 1
            elif key in BATCH_FLOATS and _close(va, vb, BATCH_FLOATS[key]):
                gaps[key] = max(gaps.get(key, 0.0), abs(va - vb))
            else:
                differ.setdefault(key, (int(row["step"]), va, vb))
    compared = sum(1 for r in a for k in r if not is_timing(k))
    detail = (
        f"{len(a)} steps, {compared} values equal (timings left out)"
        if not differ
        else "; ".join(
            f"{k} first differs at step {s}: {va!r} != {vb!r}" for k, (s, va, vb) in differ.items()
        )
    )
    if unsynced:
        fault[f"every sync/* key absent (the sync failed: steps {sorted(unsynced)})"] = len(
            unsynced
        )
    faults = ", ".join(f"{k} on {n} steps" for k, n in sorted(fault.items())) or "none differ"
    faults += "".join(
        f"; {k} within {BATCH_FLOATS[k]:g} (largest gap {g:.2g})" for k, g in gaps.items()
    )
    return (
        Check(
            name="metrics equal, step by step", ok=not differ and len(a) == len(b), detail=detail
        ),
        Check(name="fault-dependent keys (not a failure)", ok=True, detail=faults),
    )


def check_prompts(clean: Path, chaos: Path) -> Check:
    """Every prompt trained as often as in the unbroken run, in the same steps and groups
    (rollouts.jsonl, which the harness makes record every sample)."""
    a, pa = read_lines(clean / "rollouts.jsonl")
    b, pb = read_lines(chaos / "rollouts.jsonl")
    key = lambda r: (int(r["step"]), int(r["index"]), int(r["group_index"]))  # noqa: E731
    ca, cb = collections.Counter(map(key, a)), collections.Counter(map(key, b))
    uses_a = collections.Counter(int(r["index"]) for r in a)
    uses_b = collections.Counter(int(r["index"]) for r in b)
    problems = pb + [f"(unbroken) {p}" for p in pa]
    if ca != cb:
        only = sorted((ca - cb).items())[:3], sorted((cb - ca).items())[:3]
        problems.append(
            f"(step, prompt, group) samples differ: unbroken only {only[0]}, chaos only {only[1]}"
        )
    if uses_a != uses_b:
        problems.append(
            f"prompt uses differ: unbroken more {sorted((uses_a - uses_b).items())[:5]}, "
            f"chaos more {sorted((uses_b - uses_a).items())[:5]}"
        )
    detail = "; ".join(problems) or (
        f"{len(b)} samples of {len(uses_b)} prompts, each prompt used as often "
        f"({min(uses_b.values(), default=0)}-{max(uses_b.values(), default=0)} samples) "
        "in the same steps"
    )
    return Check(name="every prompt used as often", ok=not problems, detail=detail)


def check_weights(clean_ckpt: Path, chaos_ckpt: Path) -> Check:
    """The final checkpoints' model tensors (and optimizer state) bit-equal."""
    import torch
    from safetensors.torch import load_file

    differ = []
    for name in sorted(p.name for p in (clean_ckpt / "model").glob("*.safetensors")):
        ta, tb = load_file(clean_ckpt / "model" / name), load_file(chaos_ckpt / "model" / name)
        if ta.keys() != tb.keys():
            differ.append(f"{name}: tensors {sorted(ta.keys() ^ tb.keys())}")
        differ += [
            f"{name}:{k}" for k in sorted(ta.keys() & tb.keys()) if not torch.equal(ta[k], tb[k])
        ]
    tensors = sum(len(load_file(p)) for p in (clean_ckpt / "model").glob("*.safetensors"))
    opt_a, opt_b = clean_ckpt / "optimizer.pt", chaos_ckpt / "optimizer.pt"
    if opt_a.is_file():
        sa, sb = (torch.load(p, weights_only=True)["state"] for p in (opt_a, opt_b))
        differ += [
            f"optimizer {i}.{k}"
            for i in sorted(sa)
            for k in sorted(sa[i])
            if not torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb.get(i, {}).get(k)))
        ]
    detail = (
        f"{tensors} model tensors and the optimizer state bit-equal"
        if not differ
        else f"differ: {differ[:8]}"
    )
    return Check(name=f"final weights bit-equal ({chaos_ckpt.name})", ok=not differ, detail=detail)


def _sync_failed(clean: dict[str, Any], chaos: dict[str, Any]) -> bool:
    """The broken run's line of this step has no sync record at all (its sync failed)."""
    logged = bool(chaos)  # a step missing altogether is a failure, not a failed sync
    return logged and "sync/bytes" in clean and not any(k.startswith("sync/") for k in chaos)


def _close(a: Any, b: Any, tol: float) -> bool:
    numbers = isinstance(a, int | float) and isinstance(b, int | float)
    return numbers and abs(a - b) <= tol


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "[]"
    out, start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], None], strict=True):
        if cur != prev + 1 if cur is not None else True:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return "[" + ",".join(out) + "]"
