"""The one way the tests run the trainer: run_trainer(flags, run_dir, nproc=..., mode=...),
or start_trainer(...) for a job to poll, kill and read, and run_all(...) for many jobs
side by side. Every mode gives the same job protocol (poll, wait, kill, output):

    mode          how                                                      what it costs  what it shows
    "inprocess"   train_pretrain.main() in this process (one rank)         about 1 s      single-process behaviour
    "forked"      ranks forked from a preloaded server (forked_ranks.py)   about 1 s      the trainer in a process group
    "python"      `python trainer/train_pretrain.py` (one process)         5-8 s imports  a real process: exit codes, signals
    "torchrun"    `torchrun --nproc_per_node=N` (launcher_args: its flags) 7-9 s          launcher, restarts, rendezvous
    "legacy"      `python -m torch.distributed.launch`                     7-9 s          the legacy launcher

and run_nodes(...) for one job over several one-process torchrun "nodes", each in its own folder.

A job's output (stdout and stderr merged) goes to {run_dir}.log, or to memory in-process.
"""
import io
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scripts.dev.launching import PYTHON, TORCHRUN, TRAIN, kill_tree
from tests.support.fault_injection import install_from_env
from trainer.data import MAX_WORKER_TMPDIR

MODES = ("inprocess", "forked", "python", "torchrun", "legacy")


@dataclass
class Finished:
    returncode: int | None  # None: still running at its timeout, then killed
    stdout: str  # stdout and stderr merged
    seconds: float = 0.0


@dataclass(frozen=True)
class JobSpec:
    """A training job for run_all (and the arguments of start_trainer)."""
    flags: list
    run_dir: Path
    nproc: int = 1
    mode: str = "python"
    env: dict | None = None
    launcher_args: tuple = ()  # torchrun's own flags, e.g. ("--max-restarts=3",)
    script: Path = TRAIN  # relative: to cwd
    cwd: Path | None = None  # where a launched job starts (default: run_dir)


# ---------------------------------------------------------------------------- running
def run_trainer(flags, run_dir, nproc: int = 1, mode: str = "inprocess", env=None, timeout: float = 240,
                launcher_args=(), script=TRAIN) -> Finished:
    """Run `script FLAGS` (the trainer) to its end; past `timeout` it is killed (returncode None)."""
    job = start_trainer(JobSpec(list(flags), Path(run_dir), nproc, mode, env, tuple(launcher_args), Path(script)),
                        timeout)
    start = time.monotonic()
    code = job.wait(timeout)
    return Finished(code, job.output(), time.monotonic() - start)


def start_trainer(spec: JobSpec, timeout: float = 240):
    """The running job; an in-process one has run to its end (within `timeout`) when this returns."""
    if spec.mode not in MODES:
        raise ValueError(f"mode {spec.mode!r}: one of {MODES}")
    if spec.mode == "inprocess":
        if spec.nproc != 1:
            raise ValueError("an in-process run is one rank; use mode='forked' for a process group")
        return InProcessJob(spec, timeout)
    if spec.mode == "forked":
        from tests.support.forked_ranks import ForkedJob

        return ForkedJob(spec)
    return ProcessJob(spec)


def run_all(specs: dict, at_once: int = 2, timeout: float = 180) -> dict:
    """Run the JobSpecs, at most `at_once` at a time: start-up is most of a tiny run and keeps
    about one core busy. Returns {name: Finished}; a job still running after `timeout` seconds
    is killed and reported with returncode None. If the caller is interrupted, every job is killed."""
    pending, running, done = list(specs.items()), [], {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                name, spec = pending.pop(0)
                running.append((name, start_trainer(spec, timeout), time.monotonic()))
            time.sleep(0.05)
            for entry in list(running):
                name, job, start = entry
                late = time.monotonic() - start > timeout
                if job.poll() is None and not late:
                    continue
                if job.poll() is None:
                    job.kill()
                done[name] = Finished(None if late else job.returncode, job.output(), time.monotonic() - start)
                running.remove(entry)
    except BaseException:
        for _, job, _ in running:
            job.kill()
        raise
    return done


def run_nodes(flags, node_dirs, env=None, timeout: float = 240, script=TRAIN) -> list[Finished]:
    """One job over len(node_dirs) "nodes" on 127.0.0.1: a one-process torchrun each, started in
    its own folder (a node's own disk), meeting on a port agreed in advance as separate machines
    must. Every node still running at `timeout` (or when the caller is interrupted) is killed."""
    from scripts.dev.elastic_agents import agreed_port

    with agreed_port() as port:
        jobs = []
        try:
            for rank, node in enumerate(node_dirs):
                where = (f"--nnodes={len(node_dirs)}", f"--node_rank={rank}", "--master_addr=127.0.0.1",
                         f"--master_port={port}")
                jobs.append(ProcessJob(JobSpec(list(flags), Path(node), 1, "torchrun", env, where, Path(script))))
            codes = [job.wait(timeout) for job in jobs]
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
    return [Finished(code, job.output()) for code, job in zip(codes, jobs)]


class SharedRuns:
    """Uninterrupted runs that several test files need with the same flags, each run once
    per pytest session (conftest.py's `shared_runs` fixture holds the one instance):
    {name: (nproc, flags)} -> {name: (run_dir, Finished)}. A run is known by its process
    count and flags, so only identical runs are shared; those not run yet run two at a time."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.done = tmp_path_factory, {}

    def __call__(self, runs: dict, timeout: float = 240) -> dict:
        from tests.support.run_outputs import out_args

        keys = {name: (nproc, tuple(flags)) for name, (nproc, flags) in runs.items()}
        missing = {}
        for name, (nproc, flags) in runs.items():
            if keys[name] not in self.done and keys[name] not in [keys[m] for m in missing]:
                run_dir = self.tmp_path_factory.mktemp(name)
                missing[name] = JobSpec([*flags, *out_args(run_dir)], run_dir, nproc,
                                        "python" if nproc == 1 else "torchrun")
        for name, result in run_all(missing, timeout=timeout).items():
            self.done[keys[name]] = missing[name].run_dir, result
        return {name: self.done[key] for name, key in keys.items()}


# ---------------------------------------------------------------------------- the job kinds
class ProcessJob:
    """A launched process (python, torchrun, the legacy launcher) writing to {run_dir}.log.
    `proc` is the Popen, for what only a process takes: signals."""

    def __init__(self, spec: JobSpec, new_session: bool = False):
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(f"{spec.run_dir}.log")
        with open(self.log_path, "w") as log:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(command(spec), cwd=spec.cwd or spec.run_dir, env=run_env(spec.run_dir, spec.env),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session)

    @property
    def returncode(self):
        return self.proc.returncode

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout: float):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self):
        """SIGKILL the job with everything it started, and reap it."""
        kill_tree(self.proc.pid)
        self.proc.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class InProcessJob:
    """The trainer run in this process, to its end, at construction (see run_in_process)."""

    def __init__(self, spec: JobSpec, timeout: float):
        from trainer.train_pretrain import main

        if spec.script != TRAIN:
            argv = [str(spec.script), *map(str, spec.flags)]
            run = run_in_process(lambda: _run_script(argv), spec.run_dir, spec.env, int(timeout))
        else:
            run = run_in_process(lambda: main([str(a) for a in spec.flags]), spec.run_dir, spec.env, int(timeout))
        self.returncode, self._output = run.returncode, run.stdout

    def poll(self):
        return self.returncode

    def wait(self, timeout: float):
        return self.returncode

    def kill(self):
        pass

    def output(self) -> str:
        return self._output


def _run_script(argv):
    import runpy

    saved, sys.argv = sys.argv, argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.argv = saved


def command(spec: JobSpec) -> list[str]:
    """No --master_port: on one node both launchers then host the rendezvous store on a
    port the kernel picks (torch/distributed/run.py turns it into c10d on localhost:0),
    where a port picked by the test (bound, then released) could be lost to another process."""
    args = [str(spec.script), *map(str, spec.flags)]
    if spec.mode == "python":
        if spec.nproc != 1:
            raise ValueError("mode 'python' is one process; use 'torchrun' or 'forked'")
        return [PYTHON, *args]
    if spec.mode == "legacy":
        return [PYTHON, "-m", "torch.distributed.launch", f"--nproc_per_node={spec.nproc}", *args]
    return [*TORCHRUN, *spec.launcher_args, f"--nproc_per_node={spec.nproc}", *args]


def run_env(run_dir, extra=None) -> dict:
    env = dict(os.environ)
    # One thread per process: two ranks on two cores must not oversubscribe them. Each
    # run's temp files stay in its folder, unless that path is too long for the sockets
    # of DataLoader workers (trainer/data.py), as under a long user name or xdist.
    tmp = str(run_dir) if len(os.fsencode(str(run_dir))) <= MAX_WORKER_TMPDIR else tempfile.gettempdir()
    env.update(OMP_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
    # torch.compile keeps its kernels under the temp folder by default; the folder this
    # process would use, for every run, as a user's runs share theirs: compiled runs do
    # not all start cold (a test of compile then checks cached kernels after its first run).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    # The launched runs are CPU runs: with a GPU visible, a 2-process job would put rank 1
    # on cuda:1 (absent on a 1-GPU machine), and scripts without --device would use cuda:0.
    env["CUDA_VISIBLE_DEVICES"] = ""
    for key in [k for k in env if k.startswith(("MINIMIND_FAULT", "MINIMIND_TEST_QUOTA"))]:
        del env[key]
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------- in this process
class InProcessTimeout(Exception):
    """An in-process run that went past its time limit (a hang fails the test, not the suite)."""


def run_in_process(fn, run_dir, env=None, timeout: int = 240) -> Finished:
    """Call fn() here as a launched process would run it: in run_dir, under run_env's
    environment, on one thread (as OMP_NUM_THREADS=1 does, so results equal a launched
    run's), with stdout and stderr merged and Python warnings shown as a fresh process
    shows them. sys.exit(code) gives the returncode; an exception gives 1 and its traceback
    in the output. Afterwards every global the trainer sets is
    put back: the environment, the working directory, the SIGTERM/SIGINT handlers (the
    preemption flag installs its own), the thread count and the random generators it seeds.
    Past `timeout` seconds a SIGALRM raises InProcessTimeout inside fn(), as the timeout of
    a launched run would kill it: the run ends with code 1 instead of hanging the suite."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    saved_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    saved_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    out = io.StringIO()
    try:
        new_env = run_env(run_dir, env)
        os.environ.clear()
        os.environ.update(new_env)
        os.chdir(run_dir)
        torch.set_num_threads(1)
        signal.signal(signal.SIGALRM, _raise_timeout)
        signal.alarm(timeout)
        with redirect_stdout(out), redirect_stderr(out), warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.showwarning = _show_warning
            undo_faults = install_from_env(new_env)  # tests/support/fault_injection.py, where the env plans one
            try:
                fn()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
            finally:
                if undo_faults:
                    undo_faults()
    finally:
        signal.alarm(0)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        torch.set_num_threads(saved_threads)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])
    return Finished(code, out.getvalue())


def _raise_timeout(signum, frame):
    raise InProcessTimeout("the in-process run went past its time limit")


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
