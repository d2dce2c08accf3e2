"""Writes that a kill cannot leave half done: write a temp file beside the target, fsync,
then os.replace it over the target. Readers see the old file or the new one.

Used for weights (.pth, .safetensors), their config sidecars, resume checkpoints and
their records, whoever writes them: the trainer or scripts/convert_model.py.
"""
import hashlib
import os

import torch


class _HashingFile:
    """The file torch.save writes to, hashing the bytes on their way through: the
    checkpoint's record then costs no second read of a file of a gigabyte or more.
    torch.save only ever appends to a file object, so this is the file's sha256."""

    def __init__(self, f):
        self._f, self._digest, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self._digest.update(data)  # hashlib releases the GIL for large blocks
        self.size += memoryview(data).nbytes
        return self._f.write(data)

    def flush(self):
        self._f.flush()

    def record(self) -> dict:
        return {"size": self.size, "sha256": self._digest.hexdigest()}


def _atomic_write(path, write, mode="wb", shared=False):
    """Call write(f) on a temp file beside `path`, fsync it, then rename it over `path`.
    `shared`: processes on several machines may write `path` at once, so each writes a
    temp file of its own, named after its host and pid, and the renames cannot interleave."""
    tmp = f"{path}.{os.uname().nodename}.{os.getpid()}.tmp" if shared else f"{path}.tmp"
    with open(tmp, mode) as f:
        result = write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return result


def atomic_torch_save(obj, path) -> dict:
    """torch.save `obj` to `path` atomically. Returns the file's {size, sha256}, hashed as written."""

    def write(f):
        hashing = _HashingFile(f)
        torch.save(obj, hashing)
        return hashing.record()

    return _atomic_write(path, write)


def atomic_write_bytes(path, data: bytes):
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text: str, shared=False):
    _atomic_write(path, lambda f: f.write(text), mode="w", shared=shared)
