from __future__ import annotations

from pathlib import Path

from rollouts.data.arithmetic import make_problems, worked_solution, write_demo_datasets
from rollouts.data.loaders import load_conversations, load_prompts


def test_worked_solution_carries() -> None:
    assert worked_solution(47, 38) == "7+8=15 4+3+1=8 Answer: 85"
    assert worked_solution(95, 17) == "5+7=12 9+1+1=11 Answer: 112"
    assert worked_solution(0, 0) == "0+0=0 Answer: 0"


def test_problems_are_distinct_and_seeded() -> None:
    a = make_problems(50, 2, seed=3)
    assert len({p.question for p in a}) == 50
    assert a == make_problems(50, 2, seed=3)
    assert all(int(p.answer) == sum(map(int, p.question.split("+"))) for p in a)


def test_demo_datasets_load_and_eval_is_held_out(tmp_path: Path) -> None:
    paths = write_demo_datasets(tmp_path, n_sft=100, n_rl=100, n_eval=20)
    sft = load_conversations(paths["sft"])
    train = load_prompts(paths["train"])
    evals = load_prompts(paths["eval"])
    assert len(sft) == 100 and len(train) == 100 and len(evals) == 20
    held = {e.prompt[0]["content"] for e in evals}
    assert not held & {t.prompt[0]["content"] for t in train}
    assert not held & {c[0]["content"] for c in sft}
    assert sft[0][1]["content"].endswith("Answer: " + str(eval(sft[0][0]["content"])))


def test_prepare_hook_writes_where_the_config_points(tmp_path: Path) -> None:
    import pytest

    from rollouts.config import DataConfig
    from rollouts.data.arithmetic import prepare_addition_data

    d = tmp_path / "data"
    data = DataConfig(
        sft_path=str(d / "sft.jsonl"),
        train_path=str(d / "train.jsonl"),
        eval_path=str(d / "eval.jsonl"),
    )
    prepare_addition_data(data)
    assert len(load_prompts(d / "eval.jsonl")) == 200
    before = (d / "train.jsonl").stat().st_mtime_ns
    prepare_addition_data(data)  # existing files are kept
    assert (d / "train.jsonl").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="DIR/sft.jsonl"):
        prepare_addition_data(DataConfig(sft_path="a/x.jsonl", train_path="a/train.jsonl"))


def test_tool_conversations_and_strict_final_answer(tmp_path: Path) -> None:
    from rollouts.data.arithmetic import final_answer_reward
    from rollouts.types import Sample

    paths = write_demo_datasets(tmp_path, digits=3, n_sft=10, n_rl=10, n_eval=5, tool=True)
    conv = load_conversations(paths["sft"])[0]
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
    q = conv[0]["content"]
    assert conv[1]["content"] == f"<calculator><expression>{q}</expression></calculator>"
    assert conv[3]["content"] == f"Answer: {eval(q)}"

    def sample(*assistant: str, tool: str = "579") -> Sample:
        messages = [{"role": "user", "content": "123+456"}]
        for text in assistant:
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": tool}]
        return Sample(
            index=0,
            group_index=0,
            prompt="123+456",
            label="579",
            metadata={"messages": messages[:-1]},
        )

    assert final_answer_reward(sample("<calculator>..</calculator>", "Answer: 579")) == 1.0
    assert final_answer_reward(sample("Answer: 578")) == 0.0
    # the tool said 579 but the model never answered: no reward
    assert final_answer_reward(sample("<calculator>..</calculator>", "I think")) == 0.0
    # an agent out of turns after a tool call (the gateway records its content as None): 0
    called = sample("Answer: 579")
    called.metadata["messages"].append({"role": "assistant", "content": None, "tool_calls": []})
    assert final_answer_reward(called) == 0.0
