"""Helpers of the fault-tolerance, checkpoint-safety and bad-input tests."""
import fcntl
import hashlib
import os
import random
import re
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.forked_ranks import Forked, ForkedJob
from tests.launch_utils import TINY, TORCHRUN, TRAIN, descendants, kill_tree, out_args, run_env, train_cmd


@dataclass
class Finished:
    returncode: int
    stdout: str  # stdout and stderr merged
    seconds: float


def job(nproc, args, run_dir, env=None, launcher="torchrun", launcher_args=()) -> tuple:
    """A training job for run_all. launcher "torchrun": plain `python` for one process,
    else torchrun (`launcher_args` are torchrun's own flags, e.g. --max-restarts=3);
    "forked": the ranks forked from the preloaded trainer (tests/forked_ranks.py), for
    what the trainer does in a process group rather than what the launcher does."""
    if launcher == "forked":
        if launcher_args:
            raise ValueError("forked ranks have no launcher flags; use launcher='torchrun'")
        return Forked(nproc, TRAIN, list(args)), Path(run_dir), env
    cmd = train_cmd(nproc, args, "python" if nproc == 1 else launcher)
    if launcher_args:
        at = next(i for i, arg in enumerate(cmd) if arg.startswith("--nproc_per_node="))
        cmd[at:at] = list(launcher_args)
    return cmd, Path(run_dir), env


def run_all(jobs: dict, at_once: int = 2, timeout: float = 180) -> dict:
    """Run jobs (see `job`; a Forked job as (Forked(...), run_dir, env)), at most
    `at_once` at a time: start-up is most of a tiny run and keeps about one core busy.
    Output goes to {run_dir}.log, not a pipe, so a chatty job cannot block. Returns
    {name: Finished}; a job still running after `timeout` seconds is killed and
    reported with returncode None. If the caller is interrupted, every job is killed."""
    pending, running, done = list(jobs.items()), [], {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                name, (cmd, run_dir, env) = pending.pop(0)
                running.append((name, _start(cmd, run_dir, env), time.monotonic(), run_dir))
            time.sleep(0.05)
            for entry in list(running):
                name, proc, start, run_dir = entry
                late = time.monotonic() - start > timeout
                if proc.poll() is None and not late:
                    continue
                if proc.poll() is None:
                    _kill(proc)
                done[name] = Finished(None if late else proc.returncode, Path(f"{run_dir}.log").read_text(),
                                      time.monotonic() - start)
                running.remove(entry)
    except BaseException:
        for _, proc, _, _ in running:
            _kill(proc)
        raise
    return done


def _start(cmd, run_dir: Path, env):
    if isinstance(cmd, Forked):
        return ForkedJob(cmd, run_dir, env)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.log", "w") as log:  # the child holds its own copy of the file
        return subprocess.Popen(cmd, cwd=run_dir, env=run_env(run_dir, env), stdout=log, stderr=subprocess.STDOUT)


def _kill(proc):
    """Kill a job of run_all with everything it started, and reap it."""
    if isinstance(proc, ForkedJob):
        proc.kill()
    else:
        kill_tree(proc.pid)
        proc.wait()


# Three steps, shared by test_compile (eager DDP is what compiled runs must match) and
# test_clean_shutdown (a 2-process job that must exit cleanly). lr 5e-4, as in
# test_scaling: Adam's first updates are ~lr * sign(g), so float noise in near-zero
# gradients (fused kernels sum in another order) would otherwise exceed 1e-5. A long
# --dist_timeout: one rank may wait while the other compiles.
THREE_STEPS = [*TINY, "--learning_rate", "5e-4", "--max_steps", "3", "--save_interval", "3", "--dist_timeout", "600"]


class SharedRuns:
    """Uninterrupted runs that several test files need with the same flags, each run once
    per pytest session (conftest.py's `shared_runs` fixture holds the one instance):
    {name: (nproc, args)} -> {name: (run_dir, Finished)}. A run is known by its process
    count and flags, so only identical runs are shared; those not run yet run two at a time."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.done = tmp_path_factory, {}

    def __call__(self, runs: dict, timeout: float = 240) -> dict:
        keys = {name: (nproc, tuple(args)) for name, (nproc, args) in runs.items()}
        missing = {}
        for name, (nproc, args) in runs.items():
            if keys[name] not in self.done and keys[name] not in [keys[m] for m in missing]:
                run_dir = self.tmp_path_factory.mktemp(name)
                missing[name] = job(nproc, [*args, *out_args(run_dir)], run_dir)
        for name, result in run_all(missing, timeout=timeout).items():
            self.done[keys[name]] = missing[name][1], result
        return {name: self.done[key] for name, key in keys.items()}


# gloo's abort at exit ("terminate called without an active exception"), as the worker
# or torchrun ("Signal 6 (SIGABRT)") reports it.
ABORT_SIGNS = ("terminate called", "SIGABRT")


def assert_clean_exit(returncode, output: str, what: str = "job"):
    """A job that should succeed exited 0 and no rank aborted on the way out."""
    signs = [sign for sign in ABORT_SIGNS if sign in output]
    assert returncode == 0 and not signs, f"{what}: rc {returncode}, {signs}\n{output[-3000:]}"


@contextmanager
def agreed_port():
    """A TCP port that several launchers agree on in advance (the nodes of a multi-node
    or elastic job), kept for this test run until the block ends.

    One torchrun picks its own port; separate nodes cannot, so the test picks one. Bind
    port 0 and release it, and any process on the machine may take that port before
    torchrun binds it. Ports below the kernel's ephemeral range are never handed out by
    a bind to port 0 or to an outgoing connection, and an flock per port keeps test runs
    side by side (a soak next to a full run) off each other's port."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # Not 29xxx: torchrun's defaults (29400, 29500) are what a user's job nearby would bind.
    candidates = [p for p in range(first_ephemeral - 6000, first_ephemeral) if not 29000 <= p < 30000]
    start = random.randrange(len(candidates))
    for port in candidates[start:] + candidates[:start]:
        # /tmp, not $TMPDIR: every test run on the machine must see the same locks.
        lock = open(f"/tmp/minimind-test-port-{port}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # free now (and not in TIME_WAIT)
        except OSError:
            lock.close()
            continue
        try:
            yield port
        finally:
            lock.close()
        return
    raise RuntimeError("no free port below the ephemeral range")


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


# The elastic agent's own log records start "E1201 20:48:28.419000 29741 torch/distributed/
# elastic/agent/server/api.py:1008] ...". An agent logs (and survives, rc 0) an exception in
# its exit barrier when the agent hosting the rendezvous store exits first: a race inside
# torch seen under load after both nodes had finished, not a failure of the trainer's.
AGENT_LOG_RECORD = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/\S+\] ")


def worker_tracebacks(output: str) -> list[str]:
    """Python tracebacks in a job's output, except the launcher's: torchrun's ChildFailedError
    report (which torchrun prints whenever any worker exits non-zero) and the exceptions an
    elastic agent logs about itself (AGENT_LOG_RECORD)."""
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line and not AGENT_LOG_RECORD.match(line):
            frame = lines[i + 1] if i + 1 < len(lines) else ""
            if not ("bin/torchrun" in frame or "torch/distributed/run.py" in frame):
                found.append("\n".join(lines[i:i + 8]))
    return found


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def outputs_digest(run_dir) -> dict:
    """tree_digest of a run's checkpoint and output folders (TMPDIR litter elsewhere is ignored)."""
    return {sub: tree_digest(Path(run_dir) / sub) for sub in ("ckpt", "out")}


# ---------------------------------------------------------------------------- elastic "nodes"
# torch's shared agent TCPStore (its default) leaves a node that joins a running c10d job
# waiting forever for MASTER_ADDR (the rank-0 agent posts it in the first round only), so
# elastic jobs run with each round's own store, as the README tells users to.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class ElasticAgent:
    """One torchrun agent of an elastic c10d job on 127.0.0.1, standing in for a node.

    kill_node() SIGKILLs it and its workers together, as when the node dies; its output
    lines are kept with the monotonic time they arrived."""

    def __init__(self, port: int, args, run_dir, rdzv_conf: str = "", nnodes: str = "1:2", env=None):
        cmd = [*TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=elastic_test", "--max-restarts=3",
               *([f"--rdzv_conf={rdzv_conf}"] if rdzv_conf else []), str(TRAIN), *args]
        self.proc = subprocess.Popen(cmd, cwd=run_dir, env=run_env(run_dir, {**ELASTIC_ENV, **(env or {})}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def first_line_after(self, pattern: str, since: float) -> float | None:
        """When the first line matching `pattern` arrived after `since`, or None."""
        return next((t for t, line in list(self.lines) if t > since and re.search(pattern, line)), None)

    def worker_pids(self) -> list[int]:
        def is_worker(pid):
            try:
                return TRAIN.name in Path(f"/proc/{pid}/cmdline").read_text()
            except OSError:
                return False
        return [pid for pid in descendants(self.proc.pid)[1:] if is_worker(pid)]

    def kill_node(self):
        """SIGKILL the agent and every process under it at once, as when the node dies."""
        kill_tree(self.proc.pid)
        self.proc.wait()

    def wait(self, timeout: float) -> int | None:
        """The agent's exit code, or None after killing it when `timeout` passes first."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_node()
            return None
        self._reader.join(timeout=5)
        return self.proc.returncode


def wait_until(predicate, timeout: float, what: str, agents=()):
    """Poll `predicate` every 50 ms; on timeout kill the agents and fail, naming `what`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            for agent in agents:
                agent.kill_node()
            tails = "\n".join(agent.output[-2000:] for agent in agents)
            raise AssertionError(f"no {what} within {timeout:.0f}s\n{tails}")
        time.sleep(0.05)
