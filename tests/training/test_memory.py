"""The processes' memory per step (issue 27 item 11): the driver's and the trainer process's RSS
as metrics, and a warning on steady growth, with real processes that really grow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollouts.driver.memory import WINDOW_STEPS, MemoryWatch, rss_mb, steady_growth
from rollouts.driver.metrics import JsonlSink, MetricsLogger, read_jsonl_rows

GROWER = textwrap.dedent(
    """
    import sys
    kept = []
    print("ready", flush=True)
    for line in sys.stdin:  # each line: keep 25 MB more (written, so resident)
        kept.append(b"\\x01" * (25 << 20))
        print("grown", flush=True)
    """
)


def test_steady_growth_is_told_from_warm_up_and_a_plateau() -> None:
    warm_then_flat = [400.0, 600.0, 700.0] + [700.0 + (i % 2) for i in range(20)]
    assert steady_growth(warm_then_flat) is None
    # the demo's trainer process (step 0 on): a jump on its first steps, then flat, with rises
    # of a fraction of a MB (they once made a false warning at step 12)
    demo = [364.7, 467.0, 434.1, 547.9, 547.91, 548.0, 541.1, 544.0, 544.02, 546.2, 546.23]
    demo += [544.0, 548.0, 548.01, 548.02, 548.03]
    assert all(steady_growth(demo[:n]) is None for n in range(len(demo) + 1))
    leak = [427.0 + 34.0 * i for i in range(20)]  # the 427 -> 1101 MB in 20 steps
    assert steady_growth(leak) == pytest.approx(340.0)
    assert steady_growth(leak[:12]) is None  # too few steps to judge
    slow = [1000.0 + 5.0 * i for i in range(20)]  # 50 MB in 10 steps: under the bar
    assert steady_growth(slow) is None


def test_driver_and_trainer_rss_are_metrics_and_steady_growth_is_warned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = subprocess.Popen(
        [sys.executable, "-c", GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert trainer.stdin is not None and trainer.stdout is not None
    assert trainer.stdout.readline() == "ready\n"
    path = tmp_path / "metrics.jsonl"
    watch = MemoryWatch(processes={"driver": os.getpid(), "trainer": trainer.pid})
    logger = MetricsLogger([JsonlSink(path)], probes=[watch])
    try:
        for step in range(1, WINDOW_STEPS + 5):
            trainer.stdin.write("grow\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline() == "grown\n"
            logger.log(step, {"reward/mean": 0.5})
    finally:
        trainer.kill()
        trainer.wait()
        logger.close()
    rows = read_jsonl_rows(path)
    trainer_mb = [row["perf/trainer_rss_mb"] for row in rows]
    assert trainer_mb[-1] - trainer_mb[0] > 250.0, trainer_mb  # 13 x 25 MB
    assert all(row["perf/driver_rss_mb"] > 10.0 for row in rows)
    assert all(row["reward/mean"] == 0.5 for row in rows)
    out = capsys.readouterr().out
    assert f"warning: the trainer process (pid {trainer.pid}) grew steadily from" in out, out
    assert out.count("warning:") == 1, out  # once per window, and not for the flat driver
    assert rss_mb(trainer.pid) is None  # gone: no metric, no error
    assert watch(99) == {"perf/driver_rss_mb": pytest.approx(rss_mb(os.getpid()), rel=0.1)}
