"""Data errors a user meets (issue 27 item 10): every bad line named with its file and line,
empty text refused the same way for `prompt` and chat `content`, prompts too long for the model
dropped at load with a count (verl's overlong-prompt filter)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollouts.config import Config, DataConfig, RolloutConfig
from rollouts.data.loaders import MAX_REPORTED, DatasetError, load_conversations, load_prompts
from rollouts.driver.setup import load_rl_prompts
from rollouts.trainer.factories import load_tokenizer


def _chat(*contents: str) -> str:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return json.dumps({"messages": messages})


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9 \xff"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:2: not UTF-8 \(byte 0xe9 at byte 16"):
        load_prompts(path)
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(_chat("q", "a").encode() + b"\n" + b'{"messages": "\xff"}\n')
    with pytest.raises(DatasetError, match=rf"{chats}:2: not UTF-8"):
        load_conversations(chats)


def test_a_utf8_byte_order_mark_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [i.prompt for i in load_prompts(path)] == ["a", "b"]


def test_an_empty_chat_content_is_refused_like_an_empty_prompt(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": ""}\n' + _chat("") + "\n" + _chat("  ") + "\n")
    with pytest.raises(DatasetError) as info:
        load_prompts(prompts)
    message = str(info.value)
    assert f"{prompts}:1, column 'prompt': must be a non-empty string" in message, message
    assert f"{prompts}:2, column 'messages': message 0 (user) has an empty 'content'" in message, (
        message
    )
    assert f"{prompts}:3, column 'messages': message 0 (user) has an empty 'content'" in message, (
        message
    )
    sft = tmp_path / "sft.jsonl"
    sft.write_text(_chat("q", "a") + "\n" + _chat("q", "") + "\n")
    with pytest.raises(
        DatasetError, match=rf"{sft}:2, column 'messages': message 1 \(assistant\) has an empty"
    ):
        load_conversations(sft)


def test_an_assistant_tool_call_needs_no_text(tmp_path: Path) -> None:
    call = {"function": {"name": "calculator", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "1"},
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    assert load_conversations(path)[0][1]["tool_calls"] == [call]


def test_every_bad_line_is_reported_in_one_error_bounded(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    bad = ['{"prompt": 3}', '{"question": "q"}', "[1]", '{"prompt": "x"', '{"prompt": ""}']
    lines = ['{"prompt": "ok"}'] + [bad[i % len(bad)] for i in range(24)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}: 24 bad rows:"), message
    named = [int(n) for n in re.findall(rf"{re.escape(str(path))}:(\d+)[:,]", message)]
    assert named == list(range(2, 2 + MAX_REPORTED)), message
    assert f"... and {24 - MAX_REPORTED} more bad row(s)" in message
    sft = tmp_path / "sft.jsonl"
    sft.write_text(_chat("q") + "\n" + _chat("q", "a") + "\n" + "{}\n")
    with pytest.raises(DatasetError, match=r"2 bad rows:\n.*sft.jsonl:1: no assistant.*\n.*:3"):
        load_conversations(sft)


def _config(train: Path, max_total_tokens: int) -> Config:
    return Config(
        data=DataConfig(train_path=str(train)),
        rollout=RolloutConfig(max_total_tokens=max_total_tokens),
    )


def test_overlong_prompts_are_dropped_at_load_and_counted(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "7" * 100_000, "label": "7"}]
    rows += [{"prompt": "2" * 63, "label": "x"}, {"prompt": "2" * 64, "label": "y"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer(tiny_model_dir)  # one token per character
    kept = load_rl_prompts(_config(path, 64), "train_path", tokenizer, tiny_model_dir)
    assert [i.label for i in kept] == ["2", "x"]  # a 64-token prompt leaves no room under 64
    out = capsys.readouterr().out
    assert f"data.train_path = {str(path)!r}: 2 of 4 prompts dropped at load" in out, out
    assert "fewer than 64 tokens: rollout.max_total_tokens = 64" in out, out
    assert "the longest had 100000" in out, out
    # the model's context (512 positions) is the tighter limit under max_total_tokens = 4096
    kept = load_rl_prompts(_config(path, 4096), "train_path", tokenizer, tiny_model_dir)
    assert len(kept) == 3
    out = capsys.readouterr().out
    assert f"model.max_position_embeddings = 512 ({tiny_model_dir}/config.json)" in out, out


def test_a_dataset_of_only_overlong_prompts_is_an_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "9" * 600}) + "\n")
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(DatasetError, match="1 of 1 prompts dropped.*no prompt is left"):
        load_rl_prompts(_config(path, 1024), "train_path", tokenizer, tiny_model_dir)
