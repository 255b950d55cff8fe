"""Local data files: checked before ``datasets`` reads them, and where row ``i`` of them is.

``datasets`` reports a 0-byte JSON file as ``StopIteration``, a malformed JSON line by its character position
in the file, an empty dir as a failed hub lookup, and passes bytes that are not UTF-8 on to the first read of
the column. :func:`check_files` makes each one ``ConfigError`` line naming the file, the line and the fix
(:func:`json_error` finds the line once ``datasets`` has failed); :func:`row_location` names where row ``i``
of a dataset read from these files is (``FILE line N``), for the messages about a bad row.
"""
from __future__ import annotations

import codecs
import csv
import json
import os

from rlhf_train.infra.errors import ConfigError

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
TEXT = (".json", ".jsonl", ".csv")  # read as text: checked for UTF-8


def data_files(path: str, key: str = "data.dataset", dataset: str | None = None) -> list[str]:
    """The data files of a dir (not a ``save_to_disk`` one), by name; raises if it holds none anywhere below."""
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if os.path.splitext(f)[1].lower() in FORMATS]
    if files or any(os.path.splitext(f)[1].lower() in FORMATS or f.endswith(".py")
                    for _, _, names in os.walk(path) for f in names):
        return files  # [] and files below: a dataset repository's layout (data/train-*.parquet), read by datasets
    raise ConfigError(f"{key}={dataset or path}: the directory holds no data files (.json, .jsonl, .csv, .parquet, "
                      f".arrow); point data.dataset at a file or a dir of them")


def source_files(dataset: str) -> list[str] | None:
    """The local files :func:`rlhf_train.data.loading.load_any` reads ``dataset`` from, in its order; None for
    a ``save_to_disk`` dir or a hub name."""
    path = os.path.expanduser(str(dataset))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in ("dataset_info.json", "dataset_dict.json")):
        return data_files(path) or None
    return None


def check_files(files: list[str], key: str, dataset: str) -> None:
    """One line for a 0-byte file or a text file (JSON, CSV) whose bytes are not UTF-8."""
    for path in files:
        if os.path.getsize(path) == 0:
            raise ConfigError(f"{key}={dataset}: {path} is empty (0 bytes); write the prompt rows into it "
                              f"or remove it")
        if path.lower().endswith(TEXT):
            _check_utf8(path, key, dataset)


def _check_utf8(path: str, key: str, dataset: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # fast path: the whole file through one incremental decoder, 1 MiB at a time
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with open(path, "rb") as fh:  # slow path, only for a bad file: find the line
        for n, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{key}={dataset}: {path} line {n} is not UTF-8 (byte 0x{raw[err.start]:02x} at "
                                  f"column {err.start + 1}); save the file as UTF-8") from None


def json_error(path: str) -> str | None:
    """Where a JSON / JSON-lines file is malformed (``FILE line N is not ...; fix``), or None if it parses."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    try:  # one JSON document (an array of rows, or one object)?
        json.loads(text)
        return None
    except json.JSONDecodeError as doc_err:
        try:
            json.loads(lines[first])
        except json.JSONDecodeError:  # not JSON lines either: the document's own error
            return f"{path} line {doc_err.lineno} is not valid JSON ({doc_err.msg} at column {doc_err.colno}); fix it"
    for n, line in enumerate(lines, 1):  # JSON lines: the first bad one
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{path} line {n} is not valid JSON ({err.msg} at column {err.colno}); fix or remove that line"
        if not isinstance(row, dict):
            return (f"{path} line {n} is not a JSON object (a {type(row).__name__}); each line must be one object, "
                    f'e.g. {{"prompt": "..."}}')
    return None


def _rows_in(path: str) -> list[str]:
    """Each row's place in one file: ``line N`` (JSON lines), ``row N (line L)`` (CSV), ``row N`` (others)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".jsonl"):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            doc = json.loads(text)  # a JSON document: rows by position
            return [f"row {i + 1}" for i in range(len(doc) if isinstance(doc, list) else 1)]
        except json.JSONDecodeError:
            return [f"line {n}" for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if ext == ".csv":
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.reader(fh)
            next(reader, None)  # the header
            places, line = [], reader.line_num + 1
            for row in reader:
                if row:  # blank lines are no rows (pandas' skip_blank_lines)
                    places.append(f"row {len(places) + 1} (line {line})")
                line = reader.line_num + 1
            return places
    if ext == ".parquet":
        import pyarrow.parquet as pq

        return [f"row {i + 1}" for i in range(pq.ParquetFile(path).metadata.num_rows)]
    return []


def row_location(files: list[str] | None, i: int, split: str) -> tuple[str | None, str]:
    """Where row ``i`` (0-based, in the order read) of a dataset read from ``files`` is: ``(FILE, "line N")``; a
    dataset that is not local files (or whose rows cannot be counted): ``(None, "row N of split S")``."""
    k = i
    for path in files or ():
        places = _rows_in(path)
        if k < len(places):
            return path, places[k]
        k -= len(places)
    return None, f"row {i + 1} of split '{split}'"
