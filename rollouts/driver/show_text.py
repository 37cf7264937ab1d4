"""The sections of `rollouts show` as text (pure functions of a run's rows): the steps table,
where the steps' time went, the slowest sampled rollouts, the held-out evaluations and a sampled
conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]
# (header, metrics key, format): a column is shown when some row has its key
RL_COLUMNS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("acc", "reward/accuracy", "{:.3f}"),
    ("eval_acc", "eval/accuracy", "{:.3f}"),
    ("flat", "groups/all_equal_frac", "{:.2f}"),
    ("pass@k", "groups/pass_at_k", "{:.2f}"),
    ("kl", "train/kl", "{:.4f}"),
    ("entropy", "train/entropy", "{:.3f}"),
    ("len", "rollout/response_length_mean", "{:.1f}"),
    ("step_s", "perf/step_time_s", "{:.2f}"),
)
SFT_COLUMNS = (
    ("loss", "sft/loss", "{:.4f}"),
    ("eval_loss", "sft/eval_loss", "{:.4f}"),
    ("eval_acc", "sft/eval_accuracy", "{:.3f}"),
    ("step_s", "perf/step_time_s", "{:.2f}"),
)
MAX_TABLE_ROWS = 20  # a longer run shows evenly spaced steps (the first and the last among them)
SLOWEST = 5
MESSAGE_LINES = 6  # lines of one message shown before it is cut


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _spaced(rows: list[Row], limit: int) -> list[Row]:
    """At most `limit` rows, evenly spaced, the first and the last among them."""
    if len(rows) <= limit:
        return rows
    picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
    return [rows[i] for i in picks]


def _table(cells: list[list[str]]) -> list[str]:
    """Rows of cells as right-aligned columns (the first row the header)."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


def step_table(rows: list[Row], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    """The steps as a table of the `columns` some row has ("-" where a row has none); a long
    run's evenly spaced steps."""
    shown = [c for c in columns if any(_number(r.get(c[1])) for r in rows)]
    if not rows or not shown:
        return []
    body = [
        [str(r.get("step", "?"))]
        + [fmt.format(r[key]) if _number(r.get(key)) else "-" for _, key, fmt in shown]
        for r in _spaced(rows, MAX_TABLE_ROWS)
    ]
    lines = _table([["step", *(name for name, _, _ in shown)], *body])
    if len(body) < len(rows):
        lines.append(f"({len(body)} of {len(rows)} rows, evenly spaced)")
    return lines


def phase_lines(rows: list[Row]) -> list[str]:
    """Where the steps' time went: each `time/<phase>_s` summed over the steps, its mean and its
    share of the summed step time (`perf/step_time_s`)."""
    phases: dict[str, float] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("time/") and key.endswith("_s") and _number(value):
                phases[key[5:-2]] = phases.get(key[5:-2], 0.0) + float(value)
    steps = [float(r["perf/step_time_s"]) for r in rows if _number(r.get("perf/step_time_s"))]
    if not phases or not steps:
        return []
    total = sum(steps)
    lines = [f"{'phase':<22}{'total_s':>9}{'mean_s':>9}{'share':>10}"]
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        share = f"{100 * seconds / total:.1f}%" if "overlapped" not in name else "(beside)"
        lines.append(f"{name:<22}{seconds:>9.2f}{seconds / len(steps):>9.2f}{share:>10}")
    lines.append(f"{'step (all phases)':<22}{total:>9.2f}{total / len(steps):>9.2f}{'100%':>10}")
    if any("overlapped" in name for name in phases):
        lines.append("(beside: generation of the next batch while this step trained; not in it)")
    return lines


def _total_s(row: Row) -> float:
    return sum(float(v) for v in row.get("timing", {}).values() if _number(v))


def slowest_lines(samples: list[Row], n: int = SLOWEST) -> list[str]:
    """The `n` sampled rollouts that took longest, split into what each waited on: a slot under
    `rollout.max_concurrency` (`queue_s`), the engine (`generate_s`; a group sent as one request:
    the request's), its group's reward (`reward_s`) and teacher (`teacher_s`) scoring."""
    timed = [r for r in samples if isinstance(r.get("timing"), dict)]
    if not timed:
        return ["(no per-sample times in rollouts.jsonl: a run from before they were recorded)"]
    parts = ("queue_s", "generate_s", "reward_s", "teacher_s")
    parts = tuple(p for p in parts if any(p in r["timing"] for r in timed))
    body = [["step", "group", "prompt", "total_s", *parts, "tokens", "status", "reward", "most"]]
    for r in sorted(timed, key=_total_s, reverse=True)[:n]:
        t = r["timing"]
        reward = r.get("reward")
        body.append(
            [
                *(str(r.get(k, "?")) for k in ("step", "group_index", "index")),
                f"{_total_s(r):.3f}",
                *(f"{float(t.get(p, 0.0)):.3f}" for p in parts),
                str(r.get("response_tokens", "-")),
                str(r.get("status", "?")),
                f"{reward:.3f}" if _number(reward) else str(reward),
                max(parts, key=lambda p: float(t.get(p, 0.0)))[:-2],
            ]
        )
    return _table(body)


def held_out_lines(rows: list[Row]) -> list[str]:
    """Each held-out evaluation in eval_rollouts.jsonl: its episodes and accuracy."""
    by_step: dict[int, list[Row]] = {}
    for r in rows:
        by_step.setdefault(int(r.get("step", -1)), []).append(r)
    lines = []
    for step, episodes in sorted(by_step.items()):
        scored = [float(r["reward"]) for r in episodes if _number(r.get("reward"))]
        accuracy = f"{sum(x >= 1.0 for x in scored) / len(scored):.3f}" if scored else "-"
        lines.append(f"step {step}: {len(episodes)} episodes, accuracy {accuracy}")
    return lines


def clip(line: str, width: int) -> str:
    """`line` cut to `width` characters ("..." at the cut)."""
    assert width >= 4, f"{width=}"
    return line if len(line) <= width else line[: width - 3] + "..."


def _printable(text: str) -> str:
    """Control characters (a model's noise) as escapes, so they cannot garble the terminal."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def _message_lines(role: str, content: Any) -> list[str]:
    text = _printable(content if isinstance(content, str) else json.dumps(content))
    lines = text.split("\n") or [""]
    out = [f"  {role}: {lines[0]}", *(f"    {line}" for line in lines[1:MESSAGE_LINES])]
    if len(lines) > MESSAGE_LINES:
        out.append(f"    ... ({len(lines) - MESSAGE_LINES} more lines)")
    return out


def conversation_lines(row: Row) -> list[str]:
    """One sampled rollout: where it is, its reward, then its messages (an episode's own, else
    the prompt and the response), each message at most `MESSAGE_LINES` lines."""
    reward = row.get("reward")
    head = (
        f"-- step {row.get('step', '?')}, group {row.get('group_index', '?')}: reward "
        f"{reward} (label {row.get('label')!r}), {row.get('status', '?')}"
    )
    if "response_tokens" in row:
        head += f", {row['response_tokens']} tokens"
    if "error" in row:
        head += f"; error: {row['error']}"
    messages = row.get("messages")
    if not isinstance(messages, list):
        prompt = row.get("prompt")
        messages = prompt if isinstance(prompt, list) else [{"role": "prompt", "content": prompt}]
        messages = [*messages, {"role": "response", "content": row.get("response", "")}]
    lines = [head]
    for m in messages:
        lines += _message_lines(str(m.get("role", "?")), m.get("content", ""))
    return lines
