"""Datasets as people have them (issue 48): JSONL, JSON, parquet, a `datasets` directory and a
hub name, with a column map; every bad record named by source, row and column; mixtures that
draw by weight and resume exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollouts.config import ConfigError, DataConfig, config_from_dict
from rollouts.data.buffer import DataBuffer, MixtureSource
from rollouts.data.loaders import (
    ChatWrap,
    DatasetError,
    load_conversations,
    load_prompts,
    write_jsonl,
)
from rollouts.data.word_problems import prepare_word_problems, problems
from rollouts.types import PromptItem

# GSM8K's columns, and verl's parquet layout (a chat prompt, a nested ground truth)
GSM8K = [
    {
        "question": f"Tom has {i} apples and buys 3. How many?",
        "answer": f"{i}+3={i + 3}\n#### {i + 3}",
    }
    for i in range(6)
]
VERL = [
    {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": f"{i}+1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }
    for i in range(4)
]


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_every_kind_reads_the_same_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "g.jsonl", GSM8K)
    (tmp_path / "g.json").write_text(json.dumps(GSM8K))
    _parquet(tmp_path / "g.parquet", GSM8K)
    datasets.Dataset.from_list(GSM8K).save_to_disk(str(tmp_path / "g_disk"))
    read = [
        load_prompts(tmp_path / name, "question", "answer")
        for name in ("g.jsonl", "g.json", "g.parquet", "g_disk")
    ]
    assert all(items == read[0] for items in read), read
    assert read[0][5].prompt == GSM8K[5]["question"]
    assert read[0][5].label == "5+3=8\n#### 8"
    assert read[0][5].metadata == {}  # every column is used


def test_verl_parquet_chat_prompts_and_a_nested_label(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "verl.parquet", VERL)
    items = load_prompts(path, label_key="reward_model.ground_truth")
    assert items[2].prompt == ({"role": "user", "content": "2+1?"},)
    assert items[2].label == "3"
    assert items[2].metadata["data_source"] == "gsm8k"
    chosen = load_prompts(
        path, label_key="reward_model.ground_truth", metadata_keys=["data_source"]
    )
    assert chosen[0].metadata == {"data_source": "gsm8k"}


def test_a_datasets_directory_with_splits(tmp_path: Path) -> None:
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(GSM8K[:4]), test=datasets.Dataset.from_list(GSM8K[4:])
    )
    both.save_to_disk(str(tmp_path / "gsm"))
    test = load_prompts(tmp_path / "gsm", "question", "answer", split="test")
    assert [i.label.split("#### ")[1] for i in test] == ["7", "8"]
    with pytest.raises(DatasetError, match=r"holds the splits \['test', 'train'\]: split 'dev'"):
        load_prompts(tmp_path / "gsm", "question", "answer", split="dev")


def test_sft_conversations_from_parquet(tmp_path: Path) -> None:
    chats = [
        {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "2+2"}]},  # no assistant turn
    ]
    path = _parquet(tmp_path / "sft.parquet", chats)
    with pytest.raises(DatasetError, match=rf"{path}: row 1: no assistant message"):
        load_conversations(path)
    assert load_conversations(_parquet(tmp_path / "ok.parquet", chats[:1]))[0][1]["content"] == "2"


def test_a_bad_parquet_row_names_source_row_and_column(tmp_path: Path) -> None:
    rows = [{"question": "q0", "answer": "1"}, {"question": "", "answer": "2"}]
    rows += [{"question": None, "answer": "3"}]
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError) as info:
        load_prompts(path, "question", "answer")
    message = str(info.value)
    assert message.startswith(f"{path}: 2 bad rows:"), message
    assert f"{path}: row 1, column 'question': must be a non-empty string" in message, message
    assert f"{path}: row 2, column 'question': must be a non-empty string" in message, message
    assert "got NoneType None" in message, message


def test_a_missing_column_is_one_error_naming_the_columns(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "g.parquet", GSM8K)
    with pytest.raises(DatasetError) as info:
        load_prompts(path)  # prompt/label: not GSM8K's names
    message = str(info.value)
    assert message.startswith(f"{path}: no column 'prompt' (data.prompt_key)"), message
    assert "no column 'label' (data.label_key" in message, message
    assert "its columns: ['answer', 'question']" in message, message
    assert len(load_prompts(path, "question", label_key="")) == 6  # no labels, asked for


def test_a_non_string_prompt_names_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "ok"}, {"prompt": 7}, {"prompt": {"text": "x"}}, 3]))
    with pytest.raises(DatasetError) as info:
        load_prompts(path, label_key="")
    message = str(info.value)
    assert f"{path}: row 1, column 'prompt': must be a non-empty string or a list of" in message
    assert "got int 7" in message, message
    assert f"{path}: row 2, column 'prompt'" in message and "got dict" in message, message
    assert f"{path}: row 3: must be an object, got int" in message, message


def test_unknown_kinds_and_a_hub_name_without_network(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"d.csv: unknown dataset file type '.csv'"):
        load_prompts(tmp_path / "d.csv")
    with pytest.raises(DatasetError, match="not one written by `datasets` save_to_disk"):
        load_prompts(tmp_path)
    with pytest.raises(DatasetError, match="nope.parquet: no such dataset file"):
        load_prompts(tmp_path / "nope.parquet")
    code = "from rollouts.data.loaders import load_prompts as p; p('openai/gsm8k', split='train')"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert (
        "DatasetError: openai/gsm8k: not a local file or directory, and loading it from the HF "
        "hub failed" in done.stderr
    ), done.stderr[-2000:]
    assert "save_to_disk(DIR)" in done.stderr


def _config(*sources: dict) -> dict:
    return {"data": {"sources": list(sources)}}


def test_mixture_config_errors_name_the_entry() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_config({"name": "a", "path": "a.jsonl", "weight": 0}))
    assert "data.sources[0].weight = 0.0: must be > 0" in str(info.value)
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight = '': must be float"):
        config_from_dict(
            _config({"name": "a", "path": "a"}, {"name": "b", "path": "b", "weight": ""})
        )
    with pytest.raises(ConfigError) as info:
        config_from_dict(_config({"name": "a", "path": "x"}, {"name": "a", "path": ""}))
    assert "data.sources[1].path is empty" in str(info.value)
    assert "the names ['a'] are used twice" in str(info.value)
    with pytest.raises(ConfigError, match=r"data.train_path = 't.jsonl' with \[\[data.sources\]\]"):
        config_from_dict(
            {"data": {"train_path": "t.jsonl", "sources": [{"name": "a", "path": "a"}]}}
        )


def _source(name: str, n: int, weight: float, start: int = 0) -> MixtureSource:
    items = tuple(
        PromptItem(index=start + i, prompt=f"{name}{i}", metadata={"source": name})
        for i in range(n)
    )
    return MixtureSource(name=name, items=items, weight=weight)


def _mix(seed: int = 0) -> DataBuffer:
    return DataBuffer.mixture([_source("a", 5, 1.0), _source("b", 40, 3.0, 5)], seed=seed)


def test_a_mixture_draws_by_weight_each_source_in_its_own_epochs() -> None:
    buffer = _mix()
    drawn = [item.prompt for item in buffer.get_prompts(400)]
    counts = Counter(p[0] for p in drawn)
    assert 75 <= counts["a"] <= 125 and counts["a"] + counts["b"] == 400, counts  # 1/4 of 400
    a_first = [p for p in drawn if p[0] == "a"][:10]  # epochs of 5: each a permutation
    assert sorted(a_first[:5]) == sorted(a_first[5:]) == [f"a{i}" for i in range(5)]
    assert a_first[:5] != a_first[5:]  # reshuffled (seeded)
    metrics = buffer.source_metrics()
    assert metrics["source/a/drawn"] == counts["a"]
    assert metrics["source/a/epoch"] == counts["a"] // 5
    assert metrics["source/b/epoch"] == counts["b"] // 40
    assert [i.prompt for i in _mix(seed=1).get_prompts(50)] != drawn[:50]


def test_a_mixture_resumes_exactly_from_its_state() -> None:
    unbroken = _mix()
    whole = [i.prompt for i in unbroken.get_prompts(90)]
    first = _mix()
    head = [i.prompt for i in first.get_prompts(37)]
    resumed = _mix()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [i.prompt for i in resumed.get_prompts(53)] == whole
    assert resumed.state_dict() == unbroken.state_dict()
    other = DataBuffer.mixture([_source("a", 5, 1.0), _source("b", 39, 3.0, 5)])
    with pytest.raises(ValueError, match=r"saved with the sources \[a \(5 prompts\), b \(40"):
        other.load_state_dict(first.state_dict())
    single = DataBuffer(list(_source("a", 45, 1.0).items))
    with pytest.raises(ValueError, match=r"but the run has \[none\]"):
        single.load_state_dict(first.state_dict())


def test_text_prompts_become_chat_through_the_user_template(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "g.parquet", GSM8K[:2])
    wrap = ChatWrap(user_template="Q: {prompt}\nAnswer after ####.", system_prompt="Be brief.")
    items = load_prompts(path, "question", "answer", wrap=wrap)
    assert items[1].prompt == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Q: {GSM8K[1]['question']}\nAnswer after ####."},
    )
    chat = load_prompts(_parquet(tmp_path / "v.parquet", VERL), label_key="", wrap=wrap)
    assert chat[0].prompt == ({"role": "user", "content": "0+1?"},)  # chat stays as it is
    with pytest.raises(ConfigError, match=r"data.user_template = 'Q:': must hold \{prompt\}"):
        config_from_dict({"data": {"user_template": "Q:"}})
    with pytest.raises(ConfigError, match=r"data.sources\[0\].system_prompt is set but"):
        config_from_dict(_config({"name": "a", "path": "a", "system_prompt": "x"}))


def test_the_gsm8k_twin_writes_gsm8k_columns_with_held_out_problems(tmp_path: Path) -> None:
    data = DataConfig(
        train_path=str(tmp_path / "w/train.parquet"), eval_path=str(tmp_path / "w/test.parquet")
    )
    prepare_word_problems(data)
    train = load_prompts(data.train_path, "question", "answer")
    test = load_prompts(data.eval_path, "question", "answer")
    assert len(test) == 200 and len(train) == len(problems()) - 200
    key = lambda item: (item.prompt.split()[1], *re.findall(r"\d+", item.prompt))  # noqa: E731
    assert not {key(i) for i in test} & {key(i) for i in train}  # has/had/buys, a, b
    for item in train[:50] + test:
        worked, final = item.label.split("\n#### ")
        (a, op, b, c) = re.search(r"(\d+) ([-+*]) (\d+) = <<.*>>(\d+)", worked).groups()
        assert (
            int(c)
            == int(final)
            == {"+": int(a) + int(b), "-": int(a) - int(b)}.get(op, int(a) * int(b))
        ), item
