"""Fault injection for the fault-tolerance tests: one rank misbehaves at one step, as the
environment the test gives its run plans it:

    MINIMIND_FAULT_AT_STEP=k    global step at which to misbehave (counted from 0)
    MINIMIND_FAULT_RANK=r       which rank misbehaves (default 0)
    MINIMIND_FAULT_KIND=kind    kill  - SIGKILL itself before step k (default)
                                raise - raise RuntimeError before step k
                                nan   - make its loss NaN at step k
                                nan_forever - make its loss NaN from step k on
                                kill_in_save - SIGKILL itself inside the save of step k, once
                                        MINIMIND_FAULT_SAVE_POINT=p of its renames are done (0: at
                                        the first, before it; every finished file of a save is
                                        renamed into place, so these are all the points it can stop at)

The trainer has no hooks for this: install() wraps its functions in the process it runs in: the
loop's set_lr (called once before every optimizer step, with the step), the step's training_loss
(trainer/step.py: the one function that assembles the loss a step trains on), and for a save,
the checkpoint manager's save and os.replace. A run reaches install() whatever its launch: a launched process through
tests/support/inject/sitecustomize.py (fault_env puts that folder first on PYTHONPATH), a forked
rank (tests/support/forked_ranks.py) and an in-process run (tests/support/jobs.py) by calling it. A fault
fires only in the first attempt of a torchrun group (TORCHELASTIC_RESTART_COUNT 0 or
unset), so a restarted group runs clean.
"""
import errno
import math
import os
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

INJECT_DIR = Path(__file__).resolve().parent / "inject"


def fault_env(kind: str, at: int, rank: int = 0, save_point: int = 0) -> dict:
    """The environment that makes rank `rank` misbehave (`kind`) at step `at`."""
    return {**fault_env_base(), "MINIMIND_FAULT_AT_STEP": str(at), "MINIMIND_FAULT_RANK": str(rank),
            "MINIMIND_FAULT_KIND": kind, "MINIMIND_FAULT_SAVE_POINT": str(save_point)}


@dataclass
class FaultPlan:
    """This rank's injected fault, read from the environment once, at start-up."""
    rank: int = 0
    kind: str | None = None  # None: no fault for this rank in this attempt
    at_step: int = 0
    poisoned: bool = False  # this step's loss is to be NaN
    save_point: int = 0  # kill_in_save: renames of the save to let through
    renames_left: int | None = None  # counting down inside the save to kill in

    @classmethod
    def from_env(cls, environ=os.environ) -> "FaultPlan":
        rank = int(environ.get("RANK", "0"))
        at = environ.get("MINIMIND_FAULT_AT_STEP")
        if at is None or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return cls(rank)
        if rank != int(environ.get("MINIMIND_FAULT_RANK", "0")):
            return cls(rank)
        return cls(rank, environ.get("MINIMIND_FAULT_KIND", "kill"), int(at),
                   save_point=int(environ.get("MINIMIND_FAULT_SAVE_POINT", "0")))

    def fires(self, global_step: int, kinds) -> bool:
        if self.kind not in kinds:
            return False
        return global_step >= self.at_step if self.kind == "nan_forever" else global_step == self.at_step

    def before_step(self, global_step: int):
        if self.fires(global_step, ("kill",)):
            print(f"[fault injection] rank {self.rank} SIGKILLs itself at step {global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires(global_step, ("raise",)):
            raise RuntimeError(f"[fault injection] rank {self.rank} raises at step {global_step}")
        self.poisoned = self.fires(global_step, ("nan", "nan_forever"))

    def before_rename(self):
        """Inside the save to kill in: let save_point renames through, then SIGKILL."""
        if self.renames_left == 0:
            print(f"[fault injection] rank {self.rank} SIGKILLs itself in a save after {self.save_point} "
                  f"renames", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.renames_left is not None:
            self.renames_left -= 1


def install(plan: FaultPlan):
    """Wrap the loop's set_lr, the step's training loss and a save's renames to carry out `plan`; returns the undo."""
    import trainer.loop as loop
    import trainer.step as step_module
    from trainer.checkpoint import CheckpointManager

    set_lr, loss = loop.set_lr, step_module.training_loss
    save, replace = CheckpointManager.save, os.replace

    def save_to_kill_in(manager, global_step):
        if plan.fires(global_step, ("kill_in_save",)):
            plan.renames_left = plan.save_point
        return save(manager, global_step)

    def replace_or_kill(src, dst, **kwargs):
        plan.before_rename()
        return replace(src, dst, **kwargs)

    CheckpointManager.save, os.replace = save_to_kill_in, replace_or_kill

    def set_lr_then_fault(optimizer, optim, step, total_steps):
        plan.before_step(step)
        return set_lr(optimizer, optim, step, total_steps)

    def poisoned_loss(*args, **kwargs):
        total, parts = loss(*args, **kwargs)
        if not plan.poisoned:
            return total, parts
        return total * math.nan, {name: part * math.nan for name, part in parts.items()}

    loop.set_lr, step_module.training_loss = set_lr_then_fault, poisoned_loss

    def undo():
        loop.set_lr, step_module.training_loss = set_lr, loss
        CheckpointManager.save, os.replace = save, replace
    return undo


def install_from_env(environ=os.environ, faults: bool = True):
    """install() the plan the environment holds (unless not `faults`), and the quota of a
    SmallDisk, where it holds them; returns the undo (or None)."""
    undos = []
    if faults and environ.get("MINIMIND_FAULT_AT_STEP") is not None:
        undos.append(install(FaultPlan.from_env(environ)))
    if environ.get(QUOTA_VARIABLE):
        folder, _, size = environ[QUOTA_VARIABLE].rpartition("=")
        undos.append(install_quota(folder, int(size)))
    if not undos:
        return None
    return lambda: [undo() for undo in reversed(undos)]


# ---------------------------------------------------------------------------- a disk that fills
QUOTA_VARIABLE = "MINIMIND_TEST_QUOTA"  # "FOLDER=BYTES": writes under FOLDER past BYTES fail with ENOSPC


class SmallDisk:
    """A folder on a filesystem that fills: a tmpfs of `size` bytes where this process may mount
    one (root, as CI runs), else a plain folder whose writes the quota below refuses past `size`
    bytes (set MINIMIND_TEST_SMALL_DISK=quota to take that one anyway). `env` goes to the runs
    that write there; fill() leaves `leave` bytes free with a ballast file, empty() removes it."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size
        self.path.mkdir(parents=True, exist_ok=True)
        self.kind, self.env = "quota", {}
        if os.environ.get("MINIMIND_TEST_SMALL_DISK") != "quota" and self._mount():
            self.kind = "tmpfs"
        else:
            self.env = {**fault_env_base(), QUOTA_VARIABLE: f"{self.path}={size}"}
        self.ballast = self.path / "ballast"

    def _mount(self) -> bool:
        import subprocess

        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return done.returncode == 0

    def free(self) -> int:
        if self.kind == "tmpfs":
            return shutil.disk_usage(self.path).free
        return self.size - used_bytes(self.path)

    def fill(self, leave: int):
        """Ballast, so that about `leave` bytes stay free (tmpfs counts whole pages)."""
        with open(self.ballast, "ab") as f:
            f.write(b"\0" * max(0, self.free() - leave))

    def empty(self):
        self.ballast.unlink(missing_ok=True)

    @contextmanager
    def installed(self):
        """The quota in this process too, for writes a test makes itself (a tmpfs needs nothing)."""
        undo = install_from_env(self.env) if self.env else None
        try:
            yield self
        finally:
            if undo:
                undo()

    def close(self):
        import subprocess

        if self.kind == "tmpfs":
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def fault_env_base() -> dict:
    """What makes a launched process load tests/support/inject/sitecustomize.py."""
    return {"PYTHONPATH": str(INJECT_DIR)}


MiB = 1 << 20


def size_of(path: Path) -> int:
    """A file's bytes, or a folder's summed over its files."""
    return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size


def used_bytes(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names
               if os.path.isfile(os.path.join(root, name)))


class QuotaFile:
    """A file under a quota'd folder: a write that would take the folder past its quota raises
    ENOSPC, as a full disk does; the rest is the real file's."""

    def __init__(self, file, folder: Path, size: int):
        self._file, self._folder, self._size = file, folder, size

    def write(self, data):
        self._file.flush()
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if used_bytes(self._folder) + size > self._size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._file.name)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __iter__(self):
        return iter(self._file)


def install_quota(folder: str, size: int):
    """Writes under `folder` refused past `size` bytes, and the disk's free space reported as what
    is left of them. Returns the undo."""
    import builtins
    import io

    folder, real_open, real_usage = Path(folder).resolve(), io.open, shutil.disk_usage

    def quota_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and Path(file).resolve().is_relative_to(folder)
        return QuotaFile(f, folder, size) if inside and set(mode) & set("wax+") else f

    def quota_usage(path):
        if Path(path).resolve().is_relative_to(folder):
            used = used_bytes(folder)
            return shutil._ntuple_diskusage(size, used, max(0, size - used))
        return real_usage(path)

    builtins.open = io.open = quota_open
    shutil.disk_usage = quota_usage

    def undo():
        builtins.open = io.open = real_open
        shutil.disk_usage = real_usage
    return undo
