"""Writing files so that neither a kill nor a full or failing disk leaves one half done, and
the one line a failed write becomes; and the start-up check that the folders a run writes to
take files (and, for sharded checkpoints, are one folder all nodes share).

Every file the trainer and the scripts write goes through here: a temp file beside the target,
fsync, then os.replace over the target, so that readers see the old file or the new one. A
write that fails (an OSError: no space left, a quota, EIO, a read-only or vanished mount)
removes its temp file and raises StorageError, whose text is one line naming what was being
written and where, what the error means, the free space there against what the write
needed, and what to do.
"""
import hashlib
import os
import shutil
import socket
import tempfile
import uuid

import torch

from common.errors import UserError, os_error_of, storage_error


def remove_quietly(path):
    """Remove a file or folder if it is there; a failure to remove is not the error to report."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    except OSError:
        pass


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor in nested dicts, lists and tuples, each storage once (a tied weight is
    saved once): what a torch.save of `obj` needs, about."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.device)
        if key in seen or not obj.numel():
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


class _HashingFile:
    """The file torch.save writes to, hashing the bytes on their way through (the checkpoint's
    record then costs no second read), and keeping the OSError of a failed write: torch's zip
    writer turns it into a RuntimeError about positions."""

    def __init__(self, f):
        self._f, self._digest, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            written = self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self._digest.update(data)  # hashlib releases the GIL for large blocks
        self.size += memoryview(data).nbytes
        return written

    def flush(self):
        self._f.flush()

    def record(self) -> dict:
        return {"size": self.size, "sha256": self._digest.hexdigest()}


class AtomicFile:
    """`path`, written under a temp name beside it: write() or `file` (the open temp file) fill
    it, close() fsyncs and closes it, commit() also renames it over `path`, discard() removes it.
    A failure in any of them (an OSError, or torch's RuntimeError with one behind it) removes the
    temp file and raises StorageError's one line, naming `path`. As a context manager it commits
    on success and discards on any error. A writer that streams (scripts/prepare_data.py's) keeps
    one open across calls, and several apart: closed all before the first is renamed, a full disk
    leaves none of them in place. `shared`: processes on several machines may write `path` at
    once, so each writes a temp file of its own, named after its host and pid, and the renames
    cannot interleave."""

    def __init__(self, path, what: str, mode: str = "wb", shared: bool = False, needed: int | None = None,
                 elsewhere: str = "write elsewhere", then: str = ""):
        self.path, self.what, self.needed, self.elsewhere, self.then = str(path), what, needed, elsewhere, then
        self.tmp = f"{path}.{os.uname().nodename}.{os.getpid()}.tmp" if shared else f"{path}.tmp"
        self.file = None
        try:
            self.file = open(self.tmp, mode)
        except BaseException as exc:
            self.fail(exc)

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except BaseException as exc:
            self.fail(exc)

    def close(self):
        """The bytes on disk (fsync), the temp file closed and still under its temp name."""
        if self.file.closed:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        except BaseException as exc:
            self.fail(exc)

    def commit(self):
        self.close()
        try:
            os.replace(self.tmp, self.path)
        except BaseException as exc:
            self.fail(exc)

    def discard(self):
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass  # its bytes go anyway
        remove_quietly(self.tmp)

    def fail(self, exc: BaseException):
        """Remove the temp file and raise: the one line when a disk's error is behind `exc`, else `exc`."""
        self.discard()
        cause = os_error_of(exc) if isinstance(exc, (OSError, RuntimeError)) else None
        if cause is None:
            raise exc
        raise storage_error(cause, self.what, self.path, self.needed, self.elsewhere, self.then) from None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None:
            self.commit()
        else:
            self.fail(exc)


def atomic_write(path, write, what: str, mode: str = "wb", shared: bool = False, needed: int | None = None,
                 elsewhere: str = "write elsewhere", then: str = "", publish: bool = True):
    """Call write(f) on a temp file beside `path`, fsync it, then rename it over `path` (an
    AtomicFile); returns what write returned. On failure the temp file is gone and StorageError
    says so in one line. publish=False leaves the finished file at its temp name, `path`.tmp, for
    the caller to rename once what must precede it is written (a checkpoint waits for its record)."""
    out = AtomicFile(path, what, mode, shared, needed, elsewhere, then)
    try:
        result = write(out.file)
    except BaseException as exc:
        out.fail(exc)
    out.commit() if publish else out.close()
    return result


def atomic_torch_save(obj, path, what: str = "the file", elsewhere: str = "write elsewhere", then: str = "",
                      publish: bool = True) -> dict:
    """torch.save `obj` to `path` atomically (publish: atomic_write's). Returns the file's {size,
    sha256}, hashed as written."""

    def write(f):
        hashing = _HashingFile(f)
        try:
            torch.save(obj, hashing)
        except RuntimeError as exc:
            exc.storage_cause = hashing.error  # the disk's own error, when that is what it was
            raise
        return hashing.record()

    return atomic_write(path, write, what, needed=tensor_bytes(obj), elsewhere=elsewhere, then=then, publish=publish)


def atomic_write_bytes(path, data: bytes, what: str = "the file", elsewhere: str = "write elsewhere"):
    atomic_write(path, lambda f: f.write(data), what, needed=len(data), elsewhere=elsewhere)


def atomic_write_text(path, text: str, what: str = "the file", shared: bool = False,
                      elsewhere: str = "write elsewhere", then: str = ""):
    atomic_write(path, lambda f: f.write(text), what, mode="w", shared=shared, needed=len(text.encode()),
                 elsewhere=elsewhere, then=then)


def append_text(path, text: str, what: str = "the file"):
    """Append `text` to `path` (a log: no temp file); StorageError on failure."""
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as exc:
        raise storage_error(exc, what, path, len(text.encode())) from None


# ---------------------------------------------------------------------------- the folders, at start-up
SHARED_MARKER = ".minimind_shared_check_"


def check_output_dirs(save_dir: str, checkpoint_dir: str, sharded: bool, collectives):
    """Create --save_dir and --checkpoint_dir and make sure they take files, on every rank
    that writes there: rank 0 for weights, metrics and .pth checkpoints; every rank for
    sharded (DCP) checkpoints, whose folder must also be one folder shared by all nodes.
    Every rank calls this (`collectives`: trainer/distributed.py's) and all take the same
    decision: each check runs only when the ones before found nothing, on every rank alike.
    Raises UserError on a problem."""
    problem = None
    if collectives.rank == 0:
        problem = _writable_problem("--save_dir", save_dir) or _writable_problem("--checkpoint_dir", checkpoint_dir)
    problem = collectives.agree(problem)
    if sharded and not problem:
        problem = collectives.agree(_writable_problem("--checkpoint_dir", checkpoint_dir))
        if not problem:
            problem = _check_shared(checkpoint_dir, collectives)
    if problem:
        raise UserError(problem)


def _writable_problem(flag: str, path: str) -> str | None:
    """Create `path` if needed and write a file in it; None if that works, else one line."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".minimind_write_check_"):
            pass
    except FileExistsError:
        return f"{flag} {path}: is a file, not a folder: pass a folder path (it is created if missing)"
    except OSError as exc:
        return f"{flag} {path}: cannot create or write there ({exc.strerror or type(exc).__name__}): " \
               f"pass a folder you can write to"
    return None


def _check_shared(checkpoint_dir: str, collectives) -> str | None:
    """None if every rank sees the same --checkpoint_dir, else one line saying it is not shared.
    Rank 0 writes a marker with a fresh name (a stale one from an earlier run must not count),
    every rank looks for it after a barrier, and the answers are combined."""
    marker = os.path.join(checkpoint_dir, SHARED_MARKER + collectives.broadcast(uuid.uuid4().hex))
    if collectives.rank == 0:
        with open(marker, "w"):
            pass
    collectives.barrier()
    problem = None
    if not os.path.exists(marker):
        problem = (f"--checkpoint_dir {checkpoint_dir}: not shared by all nodes (rank {collectives.rank} on "
                   f"{socket.gethostname()} cannot see a file rank 0 wrote there); --parallel fsdp saves every "
                   f"rank's shard into one folder: pass a folder on a filesystem every node mounts at the same "
                   f"path, or use --parallel ddp")
    problem = collectives.agree(problem)  # a gather: once it returns, every rank has looked
    if collectives.rank == 0:
        os.remove(marker)
    return problem
