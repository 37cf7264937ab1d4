"""`rollouts show RUN_DIR`: a run at a glance, read from its files alone (no JSON by hand).

It prints the steps (a compact table of each phase's metrics file), where a step's time went
(the `time/*_s` phases), the slowest sampled rollouts and what they waited on (the `timing` of
each rollouts.jsonl row: a free slot under `rollout.max_concurrency`, the engine, the reward
function), the held-out evaluations, and a few sampled conversations with their rewards.
`--step K` picks the step whose samples are shown (default: the last one written).

It reads config.json, metrics.jsonl, sft_metrics.jsonl, rollouts.jsonl and eval_rollouts.jsonl
and imports neither torch nor the trainer, so it is quick and safe beside a run still going (a
torn last line is left out, and said). The words are pure functions of the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from rollouts.driver import jsonl
from rollouts.driver.show_text import (
    RL_COLUMNS,
    SFT_COLUMNS,
    Row,
    clip,
    conversation_lines,
    held_out_lines,
    phase_lines,
    slowest_lines,
    step_table,
)


class NotARunError(ValueError):
    """RUN_DIR is not a run directory (its message names the missing file)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunFiles:
    """What a run directory holds, read; `torn`: the files whose last line is incomplete."""

    root: Path
    config: Row
    rl: list[Row]
    sft: list[Row]
    samples: list[Row]
    held_out: list[Row]
    torn: tuple[str, ...] = ()


def read_rows(path: Path) -> tuple[list[Row], bool]:
    """The rows of a JSONL file (none when it is absent) and whether its last line was torn
    (a run still writing it: left out). A bad line before the last is an error naming it."""
    if not path.is_file():
        return [], False
    return jsonl.read_rows(path)


def load_run(root: Path) -> RunFiles:
    """Read a run directory; NotARunError when it is none (no config.json: every run writes
    it first)."""
    if not root.is_dir():
        raise NotARunError(f"{root}: no such directory")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise NotARunError(
            f"{root} is not a run directory: {config_path} is missing (`rollouts train` writes "
            "it when a run starts, beside metrics.jsonl and sft_metrics.jsonl)"
        )
    read = {
        name: read_rows(root / name)
        for name in ("metrics.jsonl", "sft_metrics.jsonl", "rollouts.jsonl", "eval_rollouts.jsonl")
    }
    return RunFiles(
        root=root,
        config=json.loads(config_path.read_text()),
        rl=read["metrics.jsonl"][0],
        sft=read["sft_metrics.jsonl"][0],
        samples=read["rollouts.jsonl"][0],
        held_out=read["eval_rollouts.jsonl"][0],
        torn=tuple(name for name, (_, torn) in read.items() if torn),
    )


def header_lines(run: RunFiles) -> list[str]:
    """The run directory, its config, and how far each phase got of the steps it planned."""
    config = run.config.get("config", {})
    training, rollout = config.get("training", {}), config.get("rollout", {})
    model = config.get("model", {}).get("path", "?")
    source = run.config.get("config_path") or "built in code"
    lines = [f"run {run.root}  (config {source}; model {model})"]
    if run.sft:
        planned = training.get("sft_steps") or "?"
        lines.append(f"SFT: step {max(int(r.get('step', 0)) for r in run.sft)} of {planned}")
    if run.rl:
        last = max(int(r.get("step", 0)) for r in run.rl)
        lines.append(
            f"RL: step {last} of {training.get('rl_steps', '?')}; "
            f"{config.get('algorithm', {}).get('advantage', '?')}, "
            f"{rollout.get('mode', '?')} mode, {rollout.get('batch_size', '?')} groups x "
            f"{rollout.get('n_samples_per_prompt', '?')} samples a step"
        )
    for name in run.torn:
        lines.append(f"({name}: its last line is incomplete, left out: a run still writing it)")
    return lines


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShowOptions:
    """What `rollouts show` prints: whose step's samples, how many, how wide."""

    step: int | None = None  # the step whose samples are shown; None: the last one written
    samples: int = 2
    width: int = 100

    def __post_init__(self) -> None:
        assert self.samples >= 0, f"{self.samples=} must be >= 0"
        assert self.width >= 20, f"{self.width=} must be >= 20"


def _section(title: str, lines: list[str]) -> list[str]:
    return ["", f"== {title}", *lines] if lines else []


def _sample_sections(samples: list[Row], options: ShowOptions) -> list[str]:
    """The slowest sampled rollouts (of every step, or of `--step`) and a few conversations of
    the step shown."""
    if not samples:
        return []
    written = sorted({int(r.get("step", 0)) for r in samples})
    step = written[-1] if options.step is None else options.step
    chosen = [r for r in samples if r.get("step") == step]
    if not chosen:
        steps = f"{written[0]}..{written[-1]}"
        return ["", f"no sampled rollout of step {step} in rollouts.jsonl (steps {steps})"]
    where = "every step" if options.step is None else f"step {step}"
    pool = samples if options.step is None else chosen
    out = _section(f"slowest sampled rollouts ({where}; rollouts.jsonl)", slowest_lines(pool))
    conversations = [line for r in chosen[: options.samples] for line in conversation_lines(r)]
    title = (
        f"sampled rollouts of step {step} ({min(options.samples, len(chosen))} of {len(chosen)})"
    )
    return out + _section(title, conversations)


def render(run: RunFiles, options: ShowOptions) -> list[str]:
    """Every section of `rollouts show`, as lines cut to `options.width` (sections with
    nothing to say left out)."""
    out = header_lines(run)
    if not run.rl and not run.sft:
        out.append("no step logged yet (no metrics.jsonl or sft_metrics.jsonl)")
    out += _section("SFT steps (sft_metrics.jsonl)", step_table(run.sft, SFT_COLUMNS))
    rl_title = "RL steps (metrics.jsonl; flat: the share of groups whose rewards are all equal)"
    out += _section(rl_title, step_table(run.rl, RL_COLUMNS))
    out += _section("RL phases (time/*_s, summed over the steps)", phase_lines(run.rl))
    out += _section("held-out evaluations (eval_rollouts.jsonl)", held_out_lines(run.held_out))
    out += _sample_sections(run.samples, options)
    return [clip(line, options.width) for line in out]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts show`."""
    parser.add_argument("run_dir", help="a run directory (run.output_dir)")
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step whose sampled rollouts are shown (default: the last)",
    )
    parser.add_argument(
        "--samples", type=int, default=2, help="how many sampled conversations to print (default 2)"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="cut lines to this many characters (default: the terminal's)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the run; a directory that is no run is an error naming the missing file."""
    width = args.width or shutil.get_terminal_size((100, 24)).columns
    if args.samples < 0 or width < 20:
        print(
            f"error: --samples {args.samples} must be >= 0, --width {width} >= 20", file=sys.stderr
        )
        return 2
    try:
        files = load_run(Path(args.run_dir))
    except (NotARunError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in render(files, ShowOptions(step=args.step, samples=args.samples, width=width)):
        print(line)
    return 0
