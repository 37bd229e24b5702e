"""Load a dataset from a Hub name, a local folder (saved or of data files), or json/jsonl/parquet/csv files.

A file that cannot be read is named with the 1-based line and what is wrong there (bad JSON, bytes that are not
UTF-8, an empty file), instead of the JSON reader's chained tracebacks.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import json
import logging
import os

import datasets

from .report import report_blank_lines

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
STANDARD_COLUMNS = ("prompt", "completion", "messages", "chosen", "rejected")


def _builder_for(path: str) -> str | None:
    name = path[:-3] if path.endswith(".gz") else path
    return FILE_BUILDERS.get(os.path.splitext(name)[1].lower())


def load_dataset_source(name: str, config: str | None = None, streaming: bool = False):
    """Return a DatasetDict for whatever `name` points at (an IterableDatasetDict with `streaming`: rows are read as
    they are consumed; files are still checked for being empty or undecodable first, as that costs one pass of
    reading, not of memory)."""
    files = [p.strip() for p in name.split(",") if p.strip()]
    if not files:
        raise ValueError("The dataset name is empty; give a file, a folder or a Hub dataset name.")
    if all(os.path.isfile(p) for p in files):
        builders = {_builder_for(p) for p in files}
        if None in builders or len(builders) != 1:
            raise ValueError(f"Unsupported data file type in {files}; use one of {sorted(FILE_BUILDERS)} "
                             "(optionally .gz), all of one type.")
        builder = builders.pop()
        for path in files:
            _check_not_empty(path)
            if builder in ("json", "csv"):
                _check_utf8(path)  # the JSON reader lets some invalid bytes through into the strings
            if builder == "json":
                report_blank_lines(path, blank_json_lines(path))  # the reader skips them without a word
        try:
            with _quiet("datasets"):  # its reader logs the failure before raising; the line found below says it
                data = datasets.load_dataset(builder, data_files={"train": files}, streaming=streaming)
        except Exception as error:  # the reader's own error is a chain of tracebacks: find the line ourselves
            for path in files:
                problem = diagnose_file(path, builder)
                if problem:
                    raise ValueError(problem) from error
            raise ValueError(f"{', '.join(files)}: could not be read as {builder} "
                             f"({type(error).__name__}: {_first_line(error)}).") from error
        if not streaming:
            for dataset in data.values():
                if len(dataset) == 0:
                    raise ValueError(f"{', '.join(files)}: no rows.")
        return data
    missing = [p for p in files if not os.path.exists(p)]
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(os.path.join(name, "state.json")):
            loaded = datasets.load_from_disk(name)
            loaded = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
            if streaming:
                return datasets.IterableDatasetDict({split: data.to_iterable_dataset() for split, data in loaded.items()})
            return loaded
        return _load_named(name, config, streaming)
    if len(files) > 1 or any(os.sep in p or _builder_for(p) for p in files):
        raise FileNotFoundError(f"No such dataset file or folder: {', '.join(missing) or name!r}.")
    return _load_named(name, config, streaming)


def _load_named(name: str, config: str | None, streaming: bool = False):
    """A folder of data files or a Hub dataset; a failure is one line saying which it was taken for."""
    try:
        return datasets.load_dataset(name, config, streaming=streaming)
    except (FileNotFoundError, ConnectionError, ValueError) as error:
        where = "folder" if os.path.isdir(name) else "Hub dataset (no local file or folder has that name)"
        raise ValueError(f"{name!r}: could not be loaded as a {where}: {_first_line(error)}") from error
    except Exception as error:
        if type(error).__name__ in ("DatasetNotFoundError", "DataFilesNotFoundError", "EmptyDatasetError",
                                    "HfHubHTTPError", "LocalEntryNotFoundError", "OfflineModeIsEnabled"):
            raise ValueError(f"{name!r}: no such local file or folder, and not loadable as a Hub dataset: "
                             f"{_first_line(error)}") from error
        raise


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _check_not_empty(path: str) -> None:
    with _open_bytes(path) as handle:
        head = handle.read(65536)
    if not head.strip():
        raise ValueError(f"{path}: the file is empty; it needs one example per line (jsonl) or row (csv/parquet).")


def _check_utf8(path: str, chunk_size: int = 1 << 24) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines, last_newline = 0, 0, -1
    with _open_bytes(path) as handle:
        while chunk := handle.read(chunk_size):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                position = error.start  # within this chunk (the decoder keeps at most 3 bytes of a split character)
                before = chunk[:max(position, 0)]
                line = lines + before.count(b"\n") + 1
                start_of_line = before.rfind(b"\n")
                column = position - start_of_line if start_of_line >= 0 else offset + position - last_newline
                raise ValueError(f"{path} line {line}: byte 0x{chunk[position]:02x} at column {column} is not UTF-8; "
                                 "save the file as UTF-8.") from error
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                last_newline = offset + newline
            lines += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} line {lines + 1}: the file ends inside a character that is not UTF-8; save "
                             "the file as UTF-8.") from error


def blank_json_lines(path: str) -> list[int]:
    """1-based numbers of the blank lines of a JSON-lines file, which the JSON reader skips (none for a JSON
    array or a single object: their blank lines are layout, not rows)."""
    blank, first = [], None
    with _open_bytes(path) as handle:
        for number, line in enumerate(handle, start=1):
            stripped = line.strip()
            if first is None and stripped:
                first = stripped[:1]
                if first == b"[":
                    return []
            if not stripped:
                blank.append(number)
    if first == b"{" and blank:
        try:  # a single pretty-printed object spanning lines: its blank lines are layout
            with _open_bytes(path) as handle:
                json.loads(handle.read())
            return []
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    return blank


def diagnose_file(path: str, builder: str) -> str | None:
    """What makes a text data file unreadable, with its 1-based line number; None if nothing is found."""
    if builder not in ("json", "csv"):
        return None
    with _open_bytes(path) as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        return (f"{path} line {line}: byte 0x{raw[error.start]:02x} at column {column} is not UTF-8; "
                "save the file as UTF-8.")
    if builder == "csv":
        return None
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array of objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            return f"{path} line {error.lineno}: not valid JSON ({error.msg} at column {error.colno})."
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        return None if bad is None else f"{path}: item {bad + 1} of the JSON array is not an object."
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == 1 and stripped.startswith("{"):
                try:  # a single pretty-printed JSON object spanning lines
                    json.loads(text)
                    return None
                except json.JSONDecodeError:
                    pass
            return f"{path} line {number}: not valid JSON ({error.msg}, column {error.colno}); one object a line."
        if not isinstance(row, dict):
            return f"{path} line {number}: a JSON {type(row).__name__}, not an object of column: value pairs."
    columns = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            keys = sorted(json.loads(line))
            if columns is not None and keys != columns and isinstance(json.loads(line), dict):
                return (f"{path} line {number}: columns {keys} differ from the first row's {columns}; every row "
                        "needs the same columns.")
            columns = keys if columns is None else columns
    return None


def rename_columns(dataset, column_mapping: dict[str, str] | None):
    """Read other columns as the standard ones (`--prompt_column question` reads 'question' as 'prompt').

    `dataset` is a Dataset or a DatasetDict; the mapping goes from the file's column to the standard name.
    """
    if not column_mapping:
        return dataset
    columns = dataset.column_names
    if isinstance(columns, dict):  # DatasetDict: the columns of its first split
        columns = next(iter(columns.values()), [])
    if columns is None:  # a stream read from files does not know its columns before its first row
        columns = list(next(iter(dataset), {}))
    for source, target in column_mapping.items():
        flag = f"--{target}_column"
        if source not in columns:
            raise ValueError(f"{flag} {source}: column {source!r} not found in the data; columns found: "
                             f"{sorted(columns)}.")
        if target in columns and target not in column_mapping:
            raise ValueError(f"{flag} {source}: the data already has a {target!r} column; remove it or drop "
                             f"{flag}.")
    return dataset.rename_columns(dict(column_mapping))
