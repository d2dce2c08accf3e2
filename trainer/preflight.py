"""Start-up checks of the things a flag names outside the process: the folders the run
will write to, and the temp folder DataLoader workers use (the device is trainer/device.py's). They run
before the first training step, so a typo costs one line at launch, not a run that
trains for an hour and fails at its first save.
"""
import os
import socket
import tempfile
import uuid

import torch.distributed as dist

from common.errors import UserError
from trainer.distributed import barrier, broadcast_from_main, is_main_process

SHARED_MARKER = ".minimind_shared_check_"


# A Unix socket's path holds at most 107 bytes on Linux. multiprocessing, which DataLoader
# workers use to hand batches over, binds its sockets at {tmp}/pymp-XXXXXXXX/listener-XXXXXXXX.
MAX_WORKER_TMPDIR = 107 - len("/pymp-12345678/listener-12345678")


def check_worker_tmpdir(num_workers: int):
    """With DataLoader workers, the temp folder's path must be short enough for
    multiprocessing's sockets. A longer one fails inside a worker's background thread,
    not in the trainer, which would wait for its first batch forever. (Clusters often set
    a long per-job TMPDIR.) Checked per process before any process group is made."""
    if num_workers == 0:
        return
    tmp = tempfile.gettempdir()  # where multiprocessing puts them: TMPDIR, else TEMP, TMP, /tmp
    length = len(os.fsencode(tmp))
    if length > MAX_WORKER_TMPDIR:
        raise UserError(f"--num_workers {num_workers}: the temp folder {tmp} (TMPDIR) is {length} bytes long, but "
                        f"DataLoader workers pass batches through sockets under it that allow {MAX_WORKER_TMPDIR}: "
                        f"set TMPDIR to a shorter folder, or pass --num_workers 0")


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


def _agree(problem: str | None) -> str | None:
    """The first rank's problem, on every rank, so all ranks stop or go on together."""
    if not dist.is_initialized():
        return problem
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def check_output_dirs(save_dir: str, checkpoint_dir: str, sharded: bool):
    """Create --save_dir and --checkpoint_dir and make sure they take files, on every rank
    that writes there: rank 0 for weights, metrics and .pth checkpoints; every rank for
    sharded (DCP) checkpoints, whose folder must also be one folder shared by all nodes.
    Every rank calls this; all take the same decision; raises UserError on a problem."""
    problem = None
    if is_main_process():
        problem = _writable_problem("--save_dir", save_dir) or _writable_problem("--checkpoint_dir", checkpoint_dir)
    if sharded:
        # Each check runs only when the ones before found nothing; _agree gives every rank the
        # same answer, so every rank skips, or joins, the next check's collectives alike.
        problem = _agree(problem)
        if not problem:
            problem = _writable_problem("--checkpoint_dir", checkpoint_dir)
            problem = _agree(problem)
        if not problem:
            problem = check_shared(checkpoint_dir)
    else:
        problem = broadcast_from_main(problem)
    if problem:
        raise UserError(problem)


def check_shared(checkpoint_dir: str) -> str | None:
    """None if every rank sees the same --checkpoint_dir, else one line saying it is not shared.

    Rank 0 writes a marker with a fresh name (a stale one from an earlier run must not
    count), every rank looks for it after a barrier, and the answers are combined.
    """
    token = broadcast_from_main(uuid.uuid4().hex)
    marker = os.path.join(checkpoint_dir, SHARED_MARKER + token)
    if is_main_process():
        with open(marker, "w"):
            pass
    barrier()
    problem = None
    if not os.path.exists(marker):
        problem = (f"--checkpoint_dir {checkpoint_dir}: not shared by all nodes (rank {dist.get_rank()} on "
                   f"{socket.gethostname()} cannot see a file rank 0 wrote there); --parallel fsdp saves every "
                   f"rank's shard into one folder: pass a folder on a filesystem every node mounts at the same "
                   f"path, or use --parallel ddp")
    problem = _agree(problem)  # a gather: once it returns, every rank has looked
    if is_main_process():
        os.remove(marker)
    return problem
