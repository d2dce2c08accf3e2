"""`torchrun --nproc_per_node=N SCRIPT ARGS` for the tests, without a fresh interpreter
per rank: the ranks are forked from one server process that has imported the trainer once.

A launched rank spends 5-8 s importing torch and transformers before its first step;
a tiny run then trains for a second. Tests that show what the trainer does in a process
group (DDP equals one process, a resume is bitwise exact, FSDP equals DDP) need real
processes and a real gloo group, but not a new interpreter each. So this module plays
the part of torchrun's agent, as the trainer sees it:
  * it serves the job's TCPStore and exports what torchrun exports (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE, ...);
  * each rank runs SCRIPT as `python SCRIPT ARGS` would (runpy, __name__ == "__main__"),
    in a session of its own, in the run folder, under the environment run_env gives a
    launched run, on one thread;
  * when a rank fails, the others' process groups get SIGTERM, and SIGKILL 30 s later;
    the job's code is then 1, as torchrun's is (a job of one process has that process's
    own code).
What a forked rank cannot show is left to the tests that launch the real thing:
  * torchrun itself: restarts, rendezvous, signal forwarding, several nodes, its report;
  * the interpreter's exit: a forked rank ends in os._exit, after no atexit hooks or
    static destructors, where gloo's rare abort at exit would happen (test_clean_shutdown);
  * ranks with different string-hash seeds: forked ranks share the server's, so a
    set iterated in a different order on each rank would go unnoticed here.

The server is multiprocessing's fork server, started once per pytest session on first use
(a process of its own: pytest's has threads, such as the stores of earlier jobs, and the
state of in-process runs, so it is no clean place to fork from). It only imports; it
trains nothing.
"""
import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver, process
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support import REPO_ROOT
from scripts.dev.launching import kill_tree
from tests.support.fault_injection import install_from_env
from tests.support.jobs import run_env

_CONTEXT = multiprocessing.get_context("forkserver")
_PRELOAD = "trainer.train_pretrain"
_CONTEXT.set_forkserver_preload([_PRELOAD, "tests.support.forked_ranks"])
GRACE_S = 30  # torchrun's wait between SIGTERM and SIGKILL for the ranks left


class ForkedJob:
    """One running job of tests/support/jobs.py's protocol (poll, wait, kill, output): `spec.nproc`
    ranks of `python SCRIPT FLAGS`. The ranks write, merged, to {run_dir}.log, as torchrun's
    workers share its stdout."""

    def __init__(self, spec):
        run_dir = Path(spec.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(f"{run_dir}.log")
        self.log_path.write_text("")
        self.returncode, self.failed_at = None, None
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60)) if spec.nproc > 1 else None
        base = run_env(run_dir, spec.env)
        argv = [str(a) for a in spec.flags]
        _start_server()
        self.ranks = []
        for rank in range(spec.nproc):
            rank_env = dict(base, **_launcher_env(rank, spec.nproc, self.store.port)) if spec.nproc > 1 else base
            where = (str(spec.script), argv, str(run_dir), rank_env, str(self.log_path))
            self.ranks.append(_CONTEXT.Process(target=_run_rank, name=f"rank{rank}", args=where))
        try:
            for each in self.ranks:
                each.start()
        except BaseException:
            self.kill()  # the ranks already started would wait for their peers forever
            raise

    def poll(self):
        codes = [each.exitcode for each in self.ranks]
        if self.failed_at is None and any(code not in (None, 0) for code in codes):
            self.failed_at = time.monotonic()
            self._signal(signal.SIGTERM)
        if self.failed_at is not None and time.monotonic() - self.failed_at > GRACE_S:
            self._signal(signal.SIGKILL)
        if None not in codes and self.returncode is None:
            # One process: its own code, as `python` gives it; a group: torchrun's 0 or 1.
            self.returncode = codes[0] if len(codes) == 1 else 0 if set(codes) == {0} else 1
            self.store = None
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """Wait for the job's code; past `timeout` s kill every rank and return None."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                return None
            time.sleep(0.05)
        return self.returncode

    def kill(self):
        """SIGKILL every rank left, with whatever it started (DataLoader workers), and reap them."""
        started = [each for each in self.ranks if each.pid is not None]
        for each in started:
            if each.exitcode is None:
                kill_tree(each.pid)
        for each in started:
            each.join()
        self.poll()

    def output(self) -> str:
        return self.log_path.read_text()

    def _signal(self, signum):
        for each in self.ranks:
            if each.exitcode is None and each.pid is not None:
                try:
                    os.killpg(each.pid, signum)  # the rank's session: its DataLoader workers too
                except ProcessLookupError:  # not yet its own group leader
                    try:
                        os.kill(each.pid, signum)
                    except ProcessLookupError:
                        pass


def _start_server():
    """Start the fork server (if it is not running) from the repository root: Python 3.11's
    puts its working directory, not the caller's sys.path, on the path it preloads from."""
    here = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(here)


def _launcher_env(rank: int, nproc: int, port: int) -> dict:
    """What torchrun exports to a worker of a one-node job (torch/distributed/elastic)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}


def _run_rank(script: str, argv: list, run_dir: str, env: dict, log_path: str):
    """In the forked rank: become `python SCRIPT ARGV` started in run_dir under env.
    multiprocessing turns SystemExit into the exit code and runs its own clean-up."""
    os.setsid()  # as torchrun starts its workers; a Ctrl-C to pytest's terminal is not theirs
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    if _PRELOAD not in sys.modules:  # the rank still works, but imports everything itself
        print(f"forked_ranks: the fork server did not preload {_PRELOAD}", file=sys.stderr)
    os.environ.clear()
    os.environ.update(env)
    # A fresh process would find its temp folder from the new TMPDIR; these were set
    # from the pytest process's (multiprocessing's by the Process object it pickled).
    tempfile.tempdir = None
    process.current_process()._config.pop("tempdir", None)
    # The fork server's start method is inherited too; a fresh process starts DataLoader
    # workers with the platform's default (fork on Linux), as children of its own.
    multiprocessing.set_start_method(None, force=True)
    os.chdir(run_dir)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *argv]
    install_from_env(env)  # the fault its environment plans, if any (tests/support/fault_injection.py)
    try:
        runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        traceback.print_exc()  # as Python prints it, not under multiprocessing's "Process rank0:"
        sys.exit(1)
