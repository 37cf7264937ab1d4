"""The shop task: its data (held out by item), its environment, and the agent figures it yields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.config import DataConfig
from rollouts.data.arithmetic import final_answer_reward
from rollouts.data.sft import render
from rollouts.driver.metrics import MetricsLogger
from rollouts.envs.shop import shop_env
from rollouts.envs.shop_data import SPLIT, item_names, prepare_shop_data, write_shop_datasets
from rollouts.envs.tool_format import call_text, with_tools
from rollouts.loop.episodes import episode_metrics
from rollouts.types import Sample, Status


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_held_out_questions_ask_about_held_out_items(tmp_path: Path) -> None:
    paths = write_shop_datasets(tmp_path, seed=3)
    train, evals, sft = (_rows(paths[k]) for k in ("train", "eval", "sft"))
    question = lambda r: r["messages"][-1]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in evals}
    assert not {r["item"] for r in train} & {r["item"] for r in evals}
    assert all(r["item"] in question(r) for r in train + evals)
    assert len(sft) == 22 * 9 and all(len(r["messages"]) == 7 for r in sft)  # 8 costs, 1 value
    # three ways apart: SFT's items, RL's items (SFT never showed them), the held-out items
    named = lambda text: {w for w in item_names() if f" {w} " in text}  # noqa: E731
    sft_items = set().union(*(named(r["messages"][1]["content"]) for r in sft))
    rl_items, eval_items = {r["item"] for r in train}, {r["item"] for r in evals}
    assert len(sft_items) == 22 and len(rl_items) == 59 - 15 - 22 and len(eval_items) == 15
    assert not sft_items & rl_items and not sft_items & eval_items
    # the same seed, the same catalogue; another seed, another one
    assert _rows(write_shop_datasets(tmp_path / "again", seed=3)["eval"]) == evals
    assert _rows(write_shop_datasets(tmp_path / "other", seed=4)["eval"]) != evals


def test_prepared_data_of_another_split_is_refused_naming_the_directory(tmp_path: Path) -> None:
    data = DataConfig(
        prepare="rollouts.envs.shop_data.prepare_shop_data",
        **{f"{k}_path": str(tmp_path / f"{k}.jsonl") for k in ("sft", "train", "eval")},
    )
    prepare_shop_data(data)
    assert json.loads((tmp_path / "split.json").read_text()) == SPLIT
    first = (tmp_path / "train.jsonl").read_bytes()
    prepare_shop_data(data)  # there already: left as it is
    assert (tmp_path / "train.jsonl").read_bytes() == first
    (tmp_path / "split.json").unlink()  # as an older version left it
    with pytest.raises(ValueError, match=rf"{tmp_path}: its shop data was written with another"):
        prepare_shop_data(data)


def test_sft_traces_start_as_the_agent_loop_prompts_them(tmp_path: Path, smollm2_dir: Path):
    """A trace's system message is what `with_tools` makes of a prompt row for SmolLM2."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    paths = write_shop_datasets(tmp_path)
    trace = _rows(paths["sft"])[0]["messages"]
    prompt = _rows(paths["train"])[0]
    env = shop_env(Sample(index=0, group_index=0, prompt="", metadata=prompt))
    messages, extra = with_tools(tok, [*prompt["messages"][:1], trace[1]], env.tool_specs)
    assert extra == {}  # SmolLM2's template ignores `tools`: they go in the system message
    assert render(tok, messages, True) == render(tok, trace[:2], True)


def test_an_episode_needs_both_tools(tmp_path: Path) -> None:
    row = _rows(write_shop_datasets(tmp_path)["eval"])[0]
    sample = Sample(index=0, group_index=0, prompt="", label=row["label"], metadata=row)
    env = shop_env(sample)
    item = row["item"]
    env.reset()
    seen, done, info = env.step(call_text("lookup", {"item": "nothing"}))
    assert "no item named" in seen and info["invalid_action"] and not done
    seen, done, info = env.step(call_text("lookup", {"item": item}))
    facts = json.loads(seen)
    assert not done and info["role"] == "tool" and set(facts) == {"item", "price", "stock"}
    seen, done, _ = env.step(call_text("calculator", {"expression": "12 * 11"}))
    assert seen == "132" and not done
    _, done, info = env.step(f"Answer: {row['label']}")
    assert done and info["success"] and info["tool_calls"] == 3 and info["invalid_tool_calls"] == 1


def _episode(index: int, end: str, calls: int, invalid: int, success: bool) -> Sample:
    info = {"tool_calls": calls, "invalid_tool_calls": invalid, "success": success}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Answer: 5"}]
    return Sample(
        index=index,
        group_index=0,
        prompt="q",
        label="5",
        tokens=(1, 2, 3, 4),
        loss_mask=(0, 0, 1, 1),
        response_length=2,
        status=Status.COMPLETED,
        metadata={
            "messages": messages,
            "turns": calls + 1,
            "episode_end": end,
            "episode_tokens": 10 * (index + 1),
            "sampled_tokens": 4,
            "env_info": info,
            "env_infos": [info],
        },
    )


def test_episode_metrics_count_calls_turns_tokens_and_ends() -> None:
    samples = [
        _episode(0, "answer", 2, 0, True),
        _episode(1, "answer", 3, 1, False),
        _episode(2, "budget", 4, 2, False),
        _episode(3, "context", 1, 0, False),
    ]
    m = episode_metrics(samples)
    assert m["agent/episodes"] == 4 and m["agent/success"] == 0.25
    assert m["agent/tool_calls"] == 10 and m["agent/invalid_calls"] == 3
    assert m["agent/tool_calls_mean"] == 2.5 and m["agent/turns_mean"] == 3.5
    assert m["agent/tokens_mean"] == 25.0 and m["agent/sampled_tokens_mean"] == 4.0
    ends = {k: v for k, v in m.items() if k.startswith("agent/end/") and v}
    assert ends == {"agent/end/answer": 2, "agent/end/budget": 1, "agent/end/context": 1}
    assert episode_metrics([Sample(index=0, group_index=0, prompt="q")]) == {}
    assert final_answer_reward(samples[0]) == 1.0


def test_rollouts_jsonl_holds_whole_conversations(tmp_path: Path) -> None:
    logger = MetricsLogger([], rollouts_path=tmp_path / "rollouts.jsonl")
    logger.log_samples(3, [_episode(0, "answer", 2, 0, True)], lambda ids: "text")
    [row] = _rows(tmp_path / "rollouts.jsonl")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["episode_end"] == "answer" and row["step"] == 3
