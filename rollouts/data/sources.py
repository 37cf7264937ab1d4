"""Where a dataset's rows come from: JSONL, JSON, parquet, a `datasets` directory written by
`save_to_disk`, or a hub name loaded through `datasets` (when the network allows).

Each reader yields `(where, row)`: `where` names the source and the row (`train.jsonl:12`, a line
number from 1 as editors count; `train.parquet: row 11`, a row index from 0 as `ds[11]` and
`df.iloc[11]` count), so every record error can say where to look. A row that is not an object
comes as the DatasetError saying why, in its place (the loader reports them all together).
Columnar sources also give their column names up front, so a column missing from every row is one
error, not one per row. parquet needs `pyarrow`, a `datasets` directory or a hub name `datasets`:
both in the `data` extra (`pip install 'rollouts[data]'`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

Rows = Iterator[tuple[str, "dict[str, Any] | DatasetError"]]  # a row, or why it is no row
SourceKind = Literal["jsonl", "json", "parquet", "datasets directory", "hub name"]
KINDS: tuple[SourceKind, ...] = ("jsonl", "json", "parquet", "datasets directory", "hub name")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_DISK_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_PARQUET_BATCH = 4096  # rows read at a time from a parquet file


class DatasetError(ValueError):
    """A dataset that cannot be read as asked; the message names the source, row and column."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    """A source opened for reading: its name for messages, its columns (None: per row, as in
    JSONL) and its rows."""

    name: str
    columns: tuple[str, ...] | None
    rows: Rows


def source_kind(path: str) -> SourceKind:
    """Which reader `path` needs (one of `KINDS`); a DatasetError naming the path and the kinds
    accepted when none fits."""
    p = Path(path)
    if p.is_dir():
        if any((p / marker).is_file() for marker in _DISK_MARKERS):
            return "datasets directory"
        raise DatasetError(
            f"{path}: a directory, but not one written by `datasets` save_to_disk (it has none "
            f"of {list(_DISK_MARKERS)}); point at a file ({', '.join(KINDS[:3])}) or such a "
            "directory"
        )
    if p.is_file():
        kinds: dict[str, SourceKind] = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
        kind = kinds.get(p.suffix)
        if kind is None:
            raise DatasetError(
                f"{path}: unknown dataset file type {p.suffix!r}; accepted: .jsonl, .json, "
                ".parquet, or a `datasets` save_to_disk directory"
            )
        return kind
    if p.suffix in (".jsonl", ".json", ".parquet") or not _HUB_ID.match(path):
        raise DatasetError(f"{path}: no such dataset file")
    return "hub name"


def open_table(path: str, split: str = "", subset: str = "") -> Table:
    """The rows of the dataset at `path` (see `source_kind`); `split` picks one split of a
    `datasets` directory holding several, or of a hub dataset; `subset` is a hub config name."""
    kind = source_kind(path)
    if kind == "jsonl":
        return Table(name=path, columns=None, rows=_jsonl_rows(Path(path)))
    if kind == "json":
        return Table(name=path, columns=None, rows=_json_rows(Path(path)))
    if kind == "parquet":
        return _parquet_table(path)
    return _datasets_table(path, kind, split, subset)


def _decode(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line): "
            "save the file as UTF-8"
        ) from e


def _json_line(raw: bytes, where: str, first: bool) -> dict[str, Any] | None:
    """One line as a JSON object (None for a blank line); DatasetError naming `where`."""
    line = _decode(raw, where, first)
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    return row


def _jsonl_rows(path: Path) -> Rows:
    """(`path:line`, row) of each JSON object line; a bad line's DatasetError in place of its
    row (the caller collects them all and goes on)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                row = _json_line(raw, where, first=lineno == 1)
            except DatasetError as e:
                yield where, e
                continue
            if row is not None:
                yield where, row


def _json_rows(path: Path) -> Rows:
    """A JSON file holding one list of row objects."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8: save the file as UTF-8") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, list):
        raise DatasetError(
            f"{path}: a JSON dataset must be one list of row objects, got {type(data).__name__}"
            " (a file of one object per line is JSONL: name it .jsonl)"
        )
    for i, row in enumerate(data):
        where = f"{path}: row {i}"
        if isinstance(row, dict):
            yield where, row
        else:
            yield where, DatasetError(f"{where}: must be an object, got {type(row).__name__}")


def _need(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DatasetError(
            f"{what} needs the {module.split('.')[0]!r} package: pip install 'rollouts[data]'"
        ) from e


def _parquet_table(path: str) -> Table:
    pq = _need("pyarrow.parquet", f"{path}: a parquet file")
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a parquet file
        raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    columns = tuple(file.schema_arrow.names)

    def rows() -> Rows:
        index = 0
        for batch in file.iter_batches(batch_size=_PARQUET_BATCH):
            for row in batch.to_pylist():
                yield f"{path}: row {index}", row
                index += 1

    return Table(name=path, columns=columns, rows=rows())


def _datasets_table(path: str, kind: SourceKind, split: str, subset: str) -> Table:
    datasets = _need("datasets", f"{path}: a {kind}")
    if kind == "datasets directory":
        data = datasets.load_from_disk(path)
    else:
        try:
            data = datasets.load_dataset(path, subset or None, split=split or None)
        except Exception as e:  # no network, no such dataset, a gated one: the fix is the same
            raise DatasetError(
                f"{path}: not a local file or directory, and loading it from the HF hub failed "
                f"({type(e).__name__}: {str(e)[:300]}). On a box with network: "
                f"datasets.load_dataset({path!r}{f', {subset!r}' if subset else ''})"
                ".save_to_disk(DIR), or .to_parquet(FILE) per split; then point the data path "
                "at it"
            ) from e
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            asked = f"split {split!r} is not among them" if split else "name one"
            raise DatasetError(
                f"{path}: holds the splits {sorted(data)}: {asked} (data.train_split / "
                "data.eval_split, or `split` of a [[data.sources]] entry)"
            )
        data = data[split]
    name = f"{path} [{split}]" if split else path
    return Table(
        name=name,
        columns=tuple(data.column_names),
        rows=((f"{name}: row {i}", row) for i, row in enumerate(data)),
    )
