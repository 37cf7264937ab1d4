"""The front door: `python integration_training/train.py --mode sft|rl|sft+rl --config X.toml`.

Everything lives in the `rollouts` package (`rollouts/driver/cli.py` and `run.py`); this file
only makes the documented command work from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()  # before torch loads

from rollouts.driver.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
