"""The user-error types every layer raises, the one line a disk's error becomes, and the
wrapper that turns either into one line.

A UserError's text is one line that names the culprit (a flag, a file and line, a disk) and
says what to do. dataset/ raises DataError, model/ WeightsError, a write the disk refused
StorageError (common/storage.py); a script's main() reports any of them the same way, and an
OSError nobody caught as one line too. Every stop with one line says it through say_error(),
which under torchrun also hands it to torchrun's failure report.
"""
import errno
import functools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path


class UserError(Exception):
    """Bad flags or files: str(e) is one line, printed by the script, which then exits with code 2."""


class DataError(UserError, ValueError):
    """A problem with the input data (a file and line, or a packed file's contents)."""


class WeightsError(UserError, ValueError):
    """Bad weights, an exported folder or flags that do not fit them."""


class StorageError(UserError):
    """A write (or read) the disk refused: what, where, why, the free space, and what to do."""


def free_bytes(path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing folder); None if unknown."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024


def os_error_of(exc: BaseException) -> OSError | None:
    """The disk's error behind `exc`: an OSError itself, the one a write kept for it
    (`storage_cause`), one a library names in its own words (safetensors: "os error 28"), or
    torch's zip writer's short write ("unexpected pos"), which keeps no errno."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(getattr(exc, "storage_cause", None), OSError):
        return exc.storage_cause
    found = re.search(r"os error (\d+)|code: (\d+)", str(exc))
    if found:
        code = int(found[1] or found[2])
        return OSError(code, os.strerror(code))
    if "unexpected pos" in str(exc):
        return OSError(f"a short write ({str(exc).strip()[:80]})")
    return None


def storage_error(exc: OSError, what: str, path, needed: int | None = None, elsewhere: str = "write elsewhere",
                  then: str = "") -> StorageError:
    """The one line for `exc`, raised while writing `what` to `path`: what it means, for a full
    disk the free space against what the write needed (`needed`, where known), and what to do
    (free space, or `elsewhere`; `then`: what comes after). A short write without an errno
    (torch's zip writer) on a disk left with less than it needed is a full disk."""
    free = free_bytes(path)
    code = exc.errno
    if code is None and free is not None and free < max(needed or 0, 1 << 20):
        code = errno.ENOSPC
    meaning = os.strerror(code).lower() if code else str(exc)
    if code in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR):
        return StorageError(f"cannot write {what} {path}: {meaning}; {elsewhere}: a folder you can write to")
    space = f"{size_text(free)} free there" + (f", {size_text(needed)} needed" if needed else "")
    todo = "free space there or" if code in (errno.ENOSPC, errno.EDQUOT) else "check that disk and its mount, or"
    return StorageError(f"cannot write {what} {path}: {meaning} ({space}); {todo} {elsewhere}{then}")


def os_error_line(exc: OSError) -> str:
    """An OSError no one caught where it happened, as one line naming its file and the disk's free space."""
    where = exc.filename or "a file"
    return f"{where}: {(exc.strerror or str(exc)).lower()} ({size_text(free_bytes(where))} free on its disk); " \
           f"check that path and its disk"


def tell_torchrun(line: str):
    """Under torchrun, `line` for its failure report: this worker's own TORCHELASTIC_ERROR_FILE, in
    the form torch's ErrorHandler writes. The report shows the error file of the failure with the
    earliest timestamp as its root cause, and "error_file: <N/A>" for a worker that wrote none."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:  # torchrun's own file, read only after this process is gone
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the line is on stderr already


def say_error(line: str):
    """A stop's one line: on stderr, and to torchrun's failure report."""
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)


def report_user_errors(main):
    """Decorate a script's main(): a UserError, or an OSError nobody caught, becomes `error: <one
    line>` on stderr and exit code 2, instead of a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            say_error(f"error: {e}")
            sys.exit(2)
        except OSError as e:
            say_error(f"error: {os_error_line(e)}")
            sys.exit(2)

    return wrapper
