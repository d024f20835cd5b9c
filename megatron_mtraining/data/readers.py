"""Text records from jsonl and parquet files, streamed, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .config import INPUT_SUFFIXES


def read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_key not in record:
                raise ValueError(f"{path}:{line_no}: no field text_key={text_key!r} in this record")
            if not isinstance(record[text_key], str):
                raise ValueError(
                    f"{path}:{line_no}: field {text_key!r} is {type(record[text_key]).__name__}, not a string"
                )
            yield record[text_key]


def read_parquet(path: Path, text_key: str, batch_rows: int = 1024) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    if text_key not in names:
        raise ValueError(f"{path}: no column text_key={text_key!r}; columns: {', '.join(names)}")
    column_type = file.schema_arrow.field(text_key).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ValueError(f"{path}: column {text_key!r} has type {column_type}, not string")
    row = 0
    for batch in file.iter_batches(batch_size=batch_rows, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise ValueError(f"{path}: row {row}: column {text_key!r} is null")
            yield text


def read_texts(path: Path, text_key: str) -> Iterator[str]:
    """The ``text_key`` field of every record of a ``.jsonl`` / ``.json`` (one object a line) or ``.parquet`` file."""
    reader = read_parquet if INPUT_SUFFIXES[path.suffix] == "parquet" else read_jsonl
    return reader(path, text_key)
