"""transformers draws a progress bar every time it writes or loads weights (each weight sync,
each checkpoint, each engine reload); the console keeps only the project's own progress line.
Called where a process starts: the driver (`driver/run.py`) and the trainer process
(`trainer/process_child.py`); the engine processes the driver starts inherit it.
"""

from __future__ import annotations

import os


def quiet_progress_bars() -> None:
    """Silence transformers' "Writing model shards" / "Loading weights" bars, here and in the
    engine processes started from here (they inherit HF_HUB_DISABLE_PROGRESS_BARS)."""
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "0":
        hf_logging.disable_progress_bar()
