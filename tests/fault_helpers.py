"""Helpers of the fault-tolerance, checkpoint-safety and bad-input tests."""
import hashlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.launch_utils import run_env, train_cmd


@dataclass
class Finished:
    returncode: int
    stdout: str  # stdout and stderr merged
    seconds: float


def job(nproc, args, run_dir, env=None, launcher_args=()) -> tuple:
    """A training job for run_all: plain `python` for one process, else torchrun."""
    cmd = train_cmd(nproc, args, "python" if nproc == 1 else "torchrun")
    if launcher_args:  # torchrun's own flags, e.g. --max-restarts=3
        at = next(i for i, arg in enumerate(cmd) if arg.startswith("--nproc_per_node="))
        cmd[at:at] = list(launcher_args)
    return cmd, Path(run_dir), env


def run_all(jobs: dict, at_once: int = 2, timeout: float = 180) -> dict:
    """Run jobs (see `job`), at most `at_once` at a time: start-up is most of a tiny run
    and keeps about one core busy. Output goes to {run_dir}.log, not a pipe, so a
    chatty job cannot block. Returns {name: Finished}; a job still running after
    `timeout` seconds is killed and reported with returncode None."""
    pending, running, done = list(jobs.items()), [], {}
    while pending or running:
        while pending and len(running) < at_once:
            name, (cmd, run_dir, env) = pending.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(f"{run_dir}.log", "w")
            proc = subprocess.Popen(cmd, cwd=run_dir, env=run_env(run_dir, env), stdout=log,
                                    stderr=subprocess.STDOUT, text=True)
            running.append((name, proc, log, time.monotonic(), run_dir))
        time.sleep(0.1)
        for entry in list(running):
            name, proc, log, start, run_dir = entry
            late = time.monotonic() - start > timeout
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            done[name] = Finished(None if late else proc.returncode, Path(f"{run_dir}.log").read_text(),
                                  time.monotonic() - start)
            running.remove(entry)
    return done


def tree_digest(root) -> dict:
    """{relative path: sha256 of the bytes, or '-> target' for a symlink} of every file under root."""
    root, digest = Path(root), {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def worker_tracebacks(output: str) -> list[str]:
    """Python tracebacks in a job's output, except torchrun's own ChildFailedError report
    (which torchrun prints whenever any worker exits non-zero)."""
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            frame = lines[i + 1] if i + 1 < len(lines) else ""
            if not ("bin/torchrun" in frame or "torch/distributed/run.py" in frame):
                found.append("\n".join(lines[i:i + 8]))
    return found


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def outputs_digest(run_dir) -> dict:
    """tree_digest of a run's checkpoint and output folders (TMPDIR litter elsewhere is ignored)."""
    return {sub: tree_digest(Path(run_dir) / sub) for sub in ("ckpt", "out")}
