"""
Where a corpus comes from: one file, a directory or a glob, and the documents inside
.jsonl and .parquet files, read as a stream of chunks.

Files are always taken in sorted order, so every rank and every machine that resolves
the same pattern gets the same list. Every document keeps its location (file:line for
JSONL, file + row group + row for Parquet) so that a bad one can be named.
"""

import glob
from pathlib import Path

from common.errors import DataError
from dataset.lm_dataset import iter_raw_lines, parse_line

GLOB_CHARS = "*?["
TEXT_SUFFIXES = (".jsonl", ".parquet")


def resolve_data_paths(pattern, suffixes, flag="--data_path"):
    """The files that `pattern` (a file, a directory or a glob) names, sorted.

    A single file is taken whatever its suffix; from a directory or a glob only files
    ending in one of `suffixes` are taken, so a README next to the data does no harm.
    """
    text = str(pattern)
    path = Path(text)
    wanted = " or ".join(suffixes)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file() and p.suffix in suffixes), key=str)
        if not files:
            raise DataError(f"{flag} {text}: directory has no {wanted} file; pass a directory, file or "
                            f"quoted glob of {wanted} files")
        return files
    if any(c in text for c in GLOB_CHARS):
        files = sorted((Path(p) for p in glob.glob(text, recursive=True)
                        if Path(p).is_file() and Path(p).suffix in suffixes), key=str)
        if not files:
            raise DataError(f"{flag} {text}: the pattern matches no {wanted} file; check it, and quote it "
                            f"so that the shell does not expand it")
        return files
    raise DataError(f"{flag} {text}: not found: pass an existing file, directory or quoted glob of "
                    f"{wanted} files")


def is_parquet(path):
    return Path(path).suffix == ".parquet"


# -----------------------------------------------------------------------------
# chunks of raw documents, read in the main process; decoded and checked by workers

def read_chunks(path, chunk_size, text_column="text"):
    """Yield (bytes_done, kind, records) for one input file, streaming, at most chunk_size
    records each. `bytes_done` is how far into the file (in bytes, estimated for Parquet)
    the chunk ends; decode_record turns a record into text."""
    if is_parquet(path):
        yield from _parquet_chunks(path, chunk_size, text_column)
    else:
        yield from _jsonl_chunks(path, chunk_size)


def _jsonl_chunks(path, chunk_lines):
    records, end = [], 0
    for line_number, offset, raw in iter_raw_lines(path):
        records.append((line_number, raw))
        end = offset + len(raw)
        if len(records) == chunk_lines:
            yield end, "jsonl", records
            records = []
    if records:
        yield end, "jsonl", records


def _parquet_chunks(path, chunk_rows, text_column):
    # One row group at a time, in batches, reading only the text column: RAM stays flat.
    parquet = open_parquet(path)
    names = parquet.schema_arrow.names
    if text_column not in names:
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        raise DataError(f"{path}: no column {text_column!r} (columns: {shown}); pass --text_column "
                        f"with the one that holds the text")
    total_rows = parquet.metadata.num_rows
    if total_rows == 0:
        raise DataError(f"{path}: Parquet file has no rows: pass files with at least one document")
    size, rows_done = Path(path).stat().st_size, 0
    for group in range(parquet.num_row_groups):
        row = 0
        for batch in parquet.iter_batches(batch_size=chunk_rows, row_groups=[group], columns=[text_column]):
            values = batch.column(0).to_pylist()
            rows_done += len(values)
            yield size * rows_done // total_rows, "parquet", [(group, row + i, v) for i, v in enumerate(values)]
            row += len(values)


def open_parquet(path):
    import pyarrow.parquet as pq  # only needed for Parquet inputs

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and more for a broken file
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); "
                        f"check that it is complete") from None


def decode_record(kind, path, record, text_column="text"):
    """The text of one record of a chunk, or a DataError naming where it is."""
    if kind == "jsonl":
        line_number, raw = record
        return parse_line(raw, path, line_number)
    group, row, value = record
    if isinstance(value, str):
        return value
    what = "null" if value is None else f"a {type(value).__name__}, not a string"
    raise DataError(f"{path}: row group {group}, row {row}: column {text_column!r} is {what}; "
                    f"fix the row or pass --skip_bad_lines")
