from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rollouts.data.buffer import DataBuffer
from rollouts.data.loaders import DatasetError, load_conversations, load_prompts, write_jsonl
from rollouts.types import PromptItem, Status


def _items(n: int) -> list[PromptItem]:
    return [PromptItem(index=i, prompt=f"p{i}", label=str(i)) for i in range(n)]


def test_epoch_order_is_a_seeded_permutation() -> None:
    buf = DataBuffer(_items(10), seed=1)
    first = [p.index for p in buf.get_prompts(10)]
    assert sorted(first) == list(range(10))
    assert first != list(range(10))
    again = [p.index for p in DataBuffer(_items(10), seed=1).get_prompts(10)]
    assert first == again
    other = [p.index for p in DataBuffer(_items(10), seed=2).get_prompts(10)]
    assert first != other


def test_crossing_epochs_reshuffles_without_gaps() -> None:
    buf = DataBuffer(_items(5), seed=0)
    got = [p.index for p in buf.get_prompts(12)]
    assert sorted(got[:5]) == list(range(5))
    assert sorted(got[5:10]) == list(range(5))
    assert got[:5] != got[5:10]  # epoch 1 is a different permutation (seed 0)
    assert buf.epoch_id == 2
    assert buf.sample_offset == 2
    assert buf.total_served == 12


def test_no_shuffle_keeps_file_order() -> None:
    buf = DataBuffer(_items(3), shuffle=False)
    assert [p.index for p in buf.get_prompts(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize("k", [0, 3, 7, 13])
def test_resume_gives_identical_order(k: int) -> None:
    uninterrupted = DataBuffer(_items(7), seed=5)
    expected = [p.index for p in uninterrupted.get_prompts(k + 20)][k:]

    first = DataBuffer(_items(7), seed=5)
    first.get_prompts(k)
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON (checkpoint format)
    resumed = DataBuffer(_items(7), seed=0)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert [p.index for p in resumed.get_prompts(20)] == expected


def test_groups_are_pending_samples_with_fresh_group_indices() -> None:
    buf = DataBuffer(_items(4), seed=0)
    groups = buf.get_groups(3, n_samples_per_prompt=2)
    assert len(groups) == 3
    assert all(len(g) == 2 for g in groups)
    assert [g[0].group_index for g in groups] == [0, 1, 2]
    assert all(s.status is Status.PENDING and s.tokens == () for g in groups for s in g)
    assert groups[0][0].label == str(groups[0][0].index)


def test_partial_groups_are_served_first_and_survive_resume() -> None:
    buf = DataBuffer(_items(6), seed=0)
    _, g1 = buf.get_groups(2, 2)
    partial = tuple(
        dataclasses.replace(
            s,
            tokens=(1, 2, 3),
            loss_mask=(0, 1, 1),
            response_length=2,
            rollout_logprobs=(-0.5, -0.25),
            status=Status.ABORTED,
            weight_versions=("3",),
        )
        for s in g1
    )
    buf.add_partial_groups([partial])
    assert buf.num_partial_groups == 1

    restored = DataBuffer(_items(6))
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    for b in (buf, restored):
        groups = b.get_groups(2, 2)
        assert groups[0] == partial
        assert groups[1][0].group_index == 2
        assert b.num_partial_groups == 0


def test_state_from_another_dataset_is_refused() -> None:
    state = DataBuffer(_items(3)).state_dict()
    with pytest.raises(ValueError, match="saved with 3 prompts but the dataset has 4"):
        DataBuffer(_items(4)).load_state_dict(state)


def test_load_prompts_text_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    write_jsonl(
        path,
        [
            {"prompt": "1+1=", "label": "2", "source": "a"},
            {"messages": [{"role": "user", "content": "hi"}], "label": "x"},
        ],
    )
    items = load_prompts(path)
    assert items[0].prompt == "1+1="
    assert items[0].label == "2"
    assert items[0].metadata == {"source": "a"}
    assert items[1].prompt == ({"role": "user", "content": "hi"},)
    assert [i.index for i in items] == [0, 1]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:3: invalid JSON"):
        load_prompts(path)


def test_missing_field_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: no column 'prompt'.*\['question'\]"):
        load_prompts(path)


def test_non_object_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match="bad.jsonl:1: each line must be a JSON object"):
        load_prompts(path)


def test_empty_dataset_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="empty.jsonl: the dataset is empty"):
        load_prompts(path)
    with pytest.raises(DatasetError, match="the dataset is empty"):
        load_conversations(path)


def test_conversations_need_an_assistant_turn(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
        '{"messages": [{"role": "user", "content": "q"}]}\n'
    )
    with pytest.raises(DatasetError, match="c.jsonl:2: no assistant message"):
        load_conversations(path)


def test_bad_role(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"messages": [{"role": "robot", "content": "q"}]}\n')
    with pytest.raises(
        DatasetError, match="c.jsonl:1, column 'messages': message 0 has role 'robot'"
    ):
        load_conversations(path)


def test_missing_file() -> None:
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_prompts("/nonexistent.jsonl")
