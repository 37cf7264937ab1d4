"""Where one training step stops being the same step: each `forward_backward` run twice in a row.

    python scripts/step_twice.py --mode rl --replay RUN --config C.toml --set model.path=... [...]

The arguments are `integration_training/train.py`'s, run in this process with training kept in it
(`training.trainer_process = "off"`). Each call of `TrainerCore.forward_backward` runs twice on the
same weights and batch, the gradients put back as they were between; every module's forward output
and gradient (hooks, in the order they fire) and every parameter's gradient are compared bit for
bit. The run then goes on with the second call's gradients. A `--replay` of a run's stored batches
(`logging.save_batches = true`) needs no engine, so what differs is the trainer's own arithmetic.

Per call it prints the first records that differ (forward or backward, the module, the shape,
how many elements), and the parameters whose gradients differ. Exit code 1 when any call differed.
Two same-seed runs that `scripts/same_seed.py diff` finds apart: this says whether the step itself
is the cause, and at which op (it found the "prefix" layout's gathers: `rows_of` in
`rollouts/trainer/model.py`).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHOWN = 5  # differing records printed per call


def _record(model: torch.nn.Module, records: list[tuple[str, str, torch.Tensor]]) -> list[Any]:
    """Hooks that append ("f"/"b", module name, output or its gradient) to `records`."""
    handles = []
    for name, module in model.named_modules():

        def forward(_m: Any, _i: Any, out: Any, name: str = name) -> None:
            first = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(first):
                records.append(("f", name, first.detach().clone()))

        def backward(_m: Any, _gi: Any, grad_out: Any, name: str = name) -> None:
            if grad_out and torch.is_tensor(grad_out[0]):
                records.append(("b", name, grad_out[0].detach().clone()))

        handles.append(module.register_forward_hook(forward))
        handles.append(module.register_full_backward_hook(backward))
    return handles


def _compare(call: int, runs: list[tuple[list, dict[str, torch.Tensor]]]) -> bool:
    """Print where the two runs of one call part; True when they are the same."""
    (rec_a, grads_a), (rec_b, grads_b) = runs
    shown = 0
    for a, b in zip(rec_a, rec_b, strict=False):
        if a[:2] != b[:2]:
            print(f"[step-twice] call {call}: the hooks fired in another order at {a[:2]}")
            shown = SHOWN
            break
        if a[2].shape != b[2].shape or not torch.equal(a[2], b[2]):
            apart = int((a[2] != b[2]).sum()) if a[2].shape == b[2].shape else -1
            kind = "forward" if a[0] == "f" else "gradient of the output of"
            print(f"[step-twice] call {call}: {kind} {a[1]} {tuple(a[2].shape)}: {apart} apart")
            shown += 1
            if shown >= SHOWN:
                break
    differ = [n for n, g in grads_a.items() if not torch.equal(g, grads_b[n])]
    print(
        f"[step-twice] call {call}: {len(rec_a)} records, {len(differ)} of {len(grads_a)} "
        f"parameter gradients differ{': ' + ', '.join(differ[:4]) if differ else ''}",
        flush=True,
    )
    return not differ and shown == 0 and len(rec_a) == len(rec_b)


def main() -> None:
    from rollouts.trainer.core import TrainerCore

    original = TrainerCore.forward_backward
    calls, apart = [0], [0]

    def twice(self: TrainerCore, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        params = list(self.model.parameters())
        before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        runs, out = [], None
        for k in range(2):
            records: list[tuple[str, str, torch.Tensor]] = []
            handles = _record(self.model, records)
            try:
                out = original(self, *args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()
            grads = {
                n: p.grad.detach().clone()
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }
            runs.append((records, grads))
            if k == 0:  # the gradients as they were (a call may add to an earlier one's)
                for p, grad in zip(params, before, strict=True):
                    p.grad = None if grad is None else grad.clone()
        apart[0] += not _compare(calls[0], runs)
        return out

    TrainerCore.forward_backward = twice  # type: ignore[method-assign]
    args = [*sys.argv[1:], "--set", 'training.trainer_process="off"']
    sys.argv = [str(ROOT / "integration_training/train.py"), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    print(f"[step-twice] {calls[0]} calls, {apart[0]} of them apart")
    sys.exit(1 if apart[0] else 0)


if __name__ == "__main__":
    main()
