"""Data files as memory-mapped tables: what `env = "dataset"` and `fleetrl sft` read.

`load_table` opens a local `.jsonl`, `.json`, `.parquet` or `.csv` file, or a folder that
`datasets` saved (`save_to_disk`), with the `datasets` library. A file is converted once into
Arrow in fleetrl's cache (`$FLEETRL_CACHE/datasets`, keyed by the file's path and
`file_fingerprint`), and the table is memory-mapped from there: no hub is asked, and no row
becomes a Python object until it is read. A CSV file's columns are its text; a JSON column
holds JSON's type (integers, or floats where any row has a fraction). `check_fields` checks
the fields a caller needs with Arrow's column types and compute kernels, without a Python loop
over the rows. Every bad input is one `DataFileError` line naming the file, and the row (counted from 0, as the table indexes
it) and the field where there is one: `data/train.jsonl row 17: field 'answer' is missing`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fleetrl.errors import FleetrlError, one_line
from fleetrl.files import fleetrl_cache

# The `datasets` builder of each file suffix.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# What `check_fields` can ask of a field: a string, chat messages (a non-empty list of
# {role, content} strings, other keys allowed), or any value at all; each must be present.
KINDS = {"text": "text (a string)", "messages": "chat messages (a list of {role, content} strings)", "any": "a value"}
# pyarrow's error for a JSON column whose rows hold two types (a string, then a list).
_MIXED = re.compile(r"Column\((/[^)]*)\) changed from (\w+) to (\w+)")
# How much of each end of a big file `file_fingerprint` reads.
FINGERPRINT_SPAN = 1 << 20


class DataFileError(FleetrlError, ValueError):
    """A data file that cannot be read or lacks what is asked of it. A ValueError too, so that an
    environment's constructor that raises it is reported like any bad option."""


def load_table(path: str | Path, split: str | None = None) -> datasets.Dataset:
    """The table at `path`, memory-mapped. `split` names a split of a folder holding a
    DatasetDict (default: "train", or its only split); a single file or table has none."""
    source = Path(path).expanduser()
    if source.is_dir():
        table, where = _saved_table(source, path, split), f"{path} split '{split}'" if split else str(path)
    elif not source.exists():
        raise DataFileError(f"{path}: no such file or folder")
    else:
        builder = BUILDERS.get(source.suffix.lower())
        if builder is None:
            raise DataFileError(f"{path}: not a {', '.join(list(BUILDERS)[:-1])} or {list(BUILDERS)[-1]} file, nor a "
                                "folder that `datasets` saved")
        if split is not None:
            raise DataFileError(f"{path}: a file has no named splits (split '{split}' is for a folder that `datasets` "
                                "saved)")
        if source.stat().st_size == 0:
            raise DataFileError(f"{path}: an empty file")
        try:
            with _quiet():
                # The config name keys the cache by the file's fingerprint too: `datasets` keys it by
                # path and modification time, which a rewrite within the clock's tick keeps.
                table = datasets.load_dataset(builder, data_files=str(source.resolve()), split="train",
                                              cache_dir=str(fleetrl_cache() / "datasets"),
                                              name=f"file-{file_fingerprint(source)[:16]}",
                                              **_builder_options(builder, source))
        except Exception as e:
            raise DataFileError(_unreadable(path, source, builder, e)) from e
        where = str(path)
    if len(table) == 0:
        raise DataFileError(f"{where}: no rows")
    return table


def file_fingerprint(path: str | Path) -> str:
    """A file's identity, as hex: a sha256 of its size, modification time (ns) and contents, or,
    past 2 * FINGERPRINT_SPAN bytes, of its first and last FINGERPRINT_SPAN bytes only (a
    rewrite keeps neither size nor mtime but in contrived cases; a big file is not read whole)."""
    stat = Path(path).stat()
    digest = hashlib.sha256(f"{stat.st_size} {stat.st_mtime_ns}\n".encode())
    with open(path, "rb") as f:
        if stat.st_size <= 2 * FINGERPRINT_SPAN:
            digest.update(f.read())
        else:
            digest.update(f.read(FINGERPRINT_SPAN))
            f.seek(-FINGERPRINT_SPAN, os.SEEK_END)
            digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()


def _builder_options(builder: str, source: Path) -> dict:
    if builder == "json":
        # One type per column, as Arrow stores it. `datasets` would otherwise keep a column of
        # mixed types (or of objects with other keys) as JSON text, which no kernel can check.
        return {"on_mixed_types": None, "parse_agent_traces": False}
    if builder == "csv":
        # Every column is the file's text (`007` stays `007`, not 7.0), and only an empty cell is
        # missing (not a cell that reads `NA` or `null`).
        header = pd.read_csv(source, nrows=0).columns
        return {"features": datasets.Features({name: datasets.Value("string") for name in header}),
                "keep_default_na": False, "na_values": [""]}
    return {}


def check_fields(table: datasets.Dataset, path: str | Path, fields: dict[str, str | tuple[str, ...]]) -> dict[str, str]:
    """Check that every row of `table` (as `load_table` gave it) has each field of `fields`, of
    one of the kinds given for it (a kind of KINDS, or a tuple of them); which of those kinds
    each field is. The first bad row is found by Arrow kernels, and named in the DataFileError."""
    found = {}
    for field, wanted in fields.items():
        kinds = (wanted,) if isinstance(wanted, str) else tuple(wanted)
        if unknown := set(kinds) - set(KINDS):
            raise ValueError(f"unknown field kind {sorted(unknown)[0]!r} (known: {', '.join(KINDS)})")
        if field not in table.column_names:
            raise DataFileError(f"{path}: no field '{field}' (fields: {', '.join(table.column_names)})")
        column = table.data.column(field)
        if column.null_count:
            raise DataFileError(f"{path} row {_first_true(pc.is_null(column))}: field '{field}' is missing")
        kind = _kind_of(column.type)
        if kind not in kinds and "any" not in kinds:
            # A column holds one type: the first row has it as well as any.
            raise DataFileError(f"{path} row 0: field '{field}' is {_describe(column.type)}, not "
                                f"{' or '.join(KINDS[k] for k in kinds)}")
        if kind == "messages":
            _check_messages(column, path, field)
        found[field] = kind if kind in kinds else "any"
    return found


def _kind_of(arrow_type: pa.DataType) -> str:
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        message = arrow_type.value_type
        if (pa.types.is_struct(message)
                and all(message.get_field_index(key) >= 0 and _kind_of(message.field(key).type) == "text"
                        for key in ("role", "content"))):
            return "messages"
    return "any"


def _describe(arrow_type: pa.DataType) -> str:
    if _kind_of(arrow_type) != "any":
        return KINDS[_kind_of(arrow_type)]
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "a number"
    if pa.types.is_boolean(arrow_type):
        return "a boolean"
    if pa.types.is_struct(arrow_type):
        return "an object"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return "a list"
    return str(arrow_type)


def _check_messages(column: pa.ChunkedArray, path: str | Path, field: str) -> None:
    """Every row's messages: at least one, and each with its role and content."""
    empty = pc.equal(pc.list_value_length(column), 0)
    if pc.any(empty).as_py():
        raise DataFileError(f"{path} row {_first_true(empty)}: field '{field}' holds no messages")
    offset = 0  # of the chunk's first row
    for chunk in column.chunks:
        messages = pc.list_flatten(chunk)
        parents = pc.list_parent_indices(chunk)
        for key in ("role", "content"):
            absent = pc.or_(pc.is_null(messages), pc.is_null(pc.struct_field(messages, key)))
            if pc.any(absent).as_py():
                row = offset + parents[_first_true(absent)].as_py()
                raise DataFileError(f"{path} row {row}: field '{field}' has a message without '{key}'")
        offset += len(chunk)


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int:
    return pc.index(mask, True).as_py()


def _saved_table(source: Path, path: str | Path, split: str | None) -> datasets.Dataset:
    if not any((source / name).is_file() for name in ("dataset_dict.json", "state.json")):
        raise DataFileError(f"{path}: a folder, but not one that `datasets` saved (save_to_disk writes "
                            "dataset_dict.json or state.json)")
    try:
        with _quiet():
            saved = datasets.load_from_disk(str(source))
    except Exception as e:
        raise DataFileError(f"{path}: not readable as a folder that `datasets` saved: {one_line(e)}") from e
    if isinstance(saved, datasets.Dataset):
        if split is not None:
            raise DataFileError(f"{path}: one table without named splits (split '{split}' is for a DatasetDict)")
        return saved
    if split is None:
        if "train" not in saved and len(saved) != 1:
            raise DataFileError(f"{path}: name one of its splits ({', '.join(saved)})")
        split = "train" if "train" in saved else next(iter(saved))
    if split not in saved:
        raise DataFileError(f"{path}: no split '{split}' (splits: {', '.join(saved)})")
    return saved[split]


@contextmanager
def _quiet() -> Iterator[None]:
    """No `datasets` progress bars or log lines in fleetrl's output: its failures come back as
    one DataFileError line instead."""
    verbosity, bars_were_off = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.utils.enable_progress_bars()


def _unreadable(path: str | Path, source: Path, builder: str, error: Exception) -> str:
    """The one line for a file `datasets` failed to read: the cause deepest in the chain, or,
    for a JSON column whose rows hold two types, the field and the first row of the second."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain:
        chain.append(cause)
    for e in chain:
        if builder == "json" and (mixed := _MIXED.search(str(e))):
            column, before, after = mixed.groups()
            row = _first_row_of_another_type(source, column.strip("/").split("/"))
            field = column.strip("/").replace("/[]", "[]").replace("/", ".")
            return (f"{path}{f' row {row}' if row is not None else ''}: field '{field}' is {_a(after)} here, "
                    f"{_a(before)} in the rows before it (a field holds one type in every row)")
    # The pyarrow error says what is wrong with the text; `datasets`' fallbacks after it do not.
    cause = next((e for e in chain if isinstance(e, pa.ArrowException)), chain[-1])
    return f"{path}: not readable as {builder.upper()}: {one_line(cause)}"


def _a(json_type: str) -> str:
    return f"an {json_type}" if json_type[0] in "aeiou" else f"a {json_type}"


def _first_row_of_another_type(source: Path, segments: list[str]) -> int | None:
    """The first row whose value at `segments` (a pyarrow column path: keys, and `[]` for a
    list's items) is of another JSON type than the rows before. It reads the file in Python,
    but only after loading it failed, and only as far as that row."""
    first = None
    for row, record in enumerate(_json_records(source)):
        for json_type in _json_types_at(record, segments):
            first = first or json_type
            if json_type != first:
                return row
    return None


def _json_records(source: Path) -> Iterator:
    with open(source, encoding="utf-8") as f:
        head = f.read(1 << 10).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array of rows
            yield from json.load(f)
        else:  # JSON Lines
            yield from (json.loads(line) for line in f if line.strip())


def _json_types_at(value, segments: list[str]) -> Iterator[str]:
    if not segments:
        if value is not None:
            yield ("boolean" if isinstance(value, bool) else "number" if isinstance(value, int | float)
                   else "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object")
    elif segments[0] == "[]":
        for item in value if isinstance(value, list) else ():
            yield from _json_types_at(item, segments[1:])
    elif isinstance(value, dict):
        yield from _json_types_at(value.get(segments[0]), segments[1:])
