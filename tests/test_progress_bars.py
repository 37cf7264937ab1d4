"""The quiet console: transformers' progress bars off, in this process and its children."""

from __future__ import annotations

import os

import pytest

from rollouts.progress_bars import quiet_progress_bars


def test_quiet_progress_bars_reaches_child_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    try:
        quiet_progress_bars()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
