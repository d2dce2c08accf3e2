"""Launching the trainer from a script or a test: the commands (the trainer's path, torchrun
beside this Python), and process trees, listed and killed whole. torchrun starts each worker
in a session of its own, so killing a launcher alone would leave its workers running."""
import os
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
TRAIN_SFT = REPO_ROOT / "trainer" / "train_full_sft.py"
PYTHON = sys.executable
_TORCHRUN_BIN = Path(PYTHON).parent / "torchrun"
TORCHRUN = [str(_TORCHRUN_BIN)] if _TORCHRUN_BIN.exists() else [PYTHON, "-m", "torch.distributed.run"]


def kill_tree(pid: int):
    """SIGKILL a process and everything under it. Killing a launcher alone is not enough:
    torchrun starts each worker in a session of its own, so a worker outlives it. Each
    process is stopped before its children are listed, so none can start another unseen."""
    stopped, todo = [], [pid]
    while todo:
        each = todo.pop()
        try:
            os.kill(each, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append(each)
        todo += children(each)
    for each in stopped:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """pid and every process under it, parents before children."""
    return [pid] + [d for child in children(pid) for d in descendants(child)]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for task in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
