"""torchrun agents of an elastic c10d job on 127.0.0.1, each standing in for a node, and the
port they agree on in advance: what tests/test_elastic.py and scripts/bench/bench_train.py elastic
start, SIGKILL and time."""
import fcntl
import random
import re
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from scripts.dev.launching import TORCHRUN, TRAIN, descendants, kill_tree

@contextmanager
def agreed_port():
    """A TCP port that several launchers agree on in advance (the nodes of a multi-node
    or elastic job), kept until the block ends.

    One torchrun picks its own port; separate nodes cannot, so the caller picks one. Bind
    port 0 and release it, and any process on the machine may take that port before
    torchrun binds it. Ports below the kernel's ephemeral range are never handed out by
    a bind to port 0 or to an outgoing connection, and an flock per port keeps runs side
    by side (a soak next to a full test run, a benchmark) off each other's port."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # Not 29xxx: torchrun's defaults (29400, 29500) are what a user's job nearby would bind.
    candidates = [p for p in range(first_ephemeral - 6000, first_ephemeral) if not 29000 <= p < 30000]
    start = random.randrange(len(candidates))
    for port in candidates[start:] + candidates[:start]:
        # /tmp, not $TMPDIR: every run on the machine must see the same locks.
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


# torch's shared agent TCPStore (its default) leaves a node that joins a running c10d job
# waiting forever for MASTER_ADDR (the rank-0 agent posts it in the first round only), so
# elastic jobs run with each round's own store, as docs/clusters.md tells users to.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class ElasticAgent:
    """One torchrun agent of an elastic c10d job on 127.0.0.1, standing in for a node.

    kill_node() SIGKILLs it and its workers together, as when the node dies; its output
    lines are kept with the monotonic time they arrived."""

    def __init__(self, port: int, args, run_dir, env: dict, rdzv_conf: str = "", nnodes: str = "1:2"):
        """`env`: the agent's whole environment (ELASTIC_ENV is added)."""
        cmd = [*TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=elastic_test", "--max-restarts=3",
               *([f"--rdzv_conf={rdzv_conf}"] if rdzv_conf else []), str(TRAIN), *args]
        self.proc = subprocess.Popen(cmd, cwd=run_dir, env={**env, **ELASTIC_ENV},
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
