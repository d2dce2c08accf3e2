"""Launching the trainer from a script or a test, and what the benchmarks share: the commands
(the trainer's path, torchrun beside this Python), process trees listed and killed whole, the one
way a benchmark runs the trainer or a worker script (launch), the one timer (alternate,
median_seconds) and their tables (table, row). torchrun starts each worker in a session of its
own, so killing a launcher alone would leave its workers running.

Light on purpose (nothing of the repository, no torch): every test imports it."""
import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
TRAIN_SFT = REPO_ROOT / "trainer" / "train_full_sft.py"
PYTHON = sys.executable
_TORCHRUN_BIN = Path(PYTHON).parent / "torchrun"
TORCHRUN = [str(_TORCHRUN_BIN)] if _TORCHRUN_BIN.exists() else [PYTHON, "-m", "torch.distributed.run"]
RESULT_PREFIX = "bench result: "  # the line a worker's rank 0 prints its figures on (print_result)


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


# ---------------------------------------------------------------------------- launching
@dataclass
class Launched:
    """What launch() ran and how it ended."""
    command: list
    returncode: int | None  # None: still running at its timeout, then stopped
    output: str  # stdout and stderr merged
    seconds: float  # wall time, start-up included
    peak_rss_mib: float  # of the largest process in its tree
    log: Path | None = None  # where the output was written, when launch() was given a log

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


class LaunchFailed(RuntimeError):
    pass


def launch(flags, script=TRAIN, nproc: int | None = None, env: dict | None = None, timeout: float = 0,
           log: Path | None = None, cwd=REPO_ROOT, check: bool = False) -> Launched:
    """Run `script FLAGS` to its end: as one plain process (nproc None), or under
    `torchrun --standalone` with nproc processes. env: variables set on top of this process's.
    Past `timeout` seconds (0: none) it is stopped, and returncode is None. The output goes to
    `log` (else to a temporary file) and comes back whole. check: raise LaunchFailed, with the
    end of the output, unless it ended with 0."""
    launcher = [PYTHON] if nproc is None else [*TORCHRUN, f"--nproc_per_node={nproc}", "--standalone"]
    command = [*launcher, str(script), *map(str, flags)]
    with (open(log, "w+", errors="replace") if log else tempfile.TemporaryFile("w+", errors="replace")) as out:
        start = time.monotonic()
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        returncode, usage = _wait(proc, timeout)
        seconds = time.monotonic() - start
        out.seek(0)
        result = Launched(command, returncode, out.read(), seconds, usage.ru_maxrss / 1024, Path(log) if log else None)
    if check and returncode != 0:
        why = f"timed out after {timeout:.0f} s" if returncode is None else f"rc {returncode}"
        raise LaunchFailed(f"{' '.join(command)}: {why}\n{result.tail()}")
    return result


def _wait(proc, timeout: float):
    """(exit code or None, resource usage): os.wait4's usage holds the peak RSS of the largest
    process of the tree, which Popen.wait does not give."""
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode, usage
            if deadline and time.monotonic() > deadline:
                stop(proc.pid)
                usage = os.wait4(proc.pid, 0)[2]
                proc.returncode = -signal.SIGKILL  # reaped here: Popen must not wait for it again
                return None, usage
            time.sleep(0.05)
    except KeyboardInterrupt:  # in a session of its own, it did not get our Ctrl-C
        stop(proc.pid)
        raise


def stop(pid: int, grace: float = 15):
    """SIGTERM first, which torchrun passes on to its workers, so that they end and free the GPU;
    whatever is still there after `grace` seconds is killed, tree and all."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.2)
    kill_tree(pid)


def stop_on_sigterm():
    """timeout(1) and schedulers stop a benchmark with SIGTERM: as a KeyboardInterrupt it reaches
    launch(), which stops the run it is waiting on before going."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)


def print_result(figures):
    """A worker's figures, on one line that read_result finds among the rest of its output."""
    print(RESULT_PREFIX + json.dumps(figures), flush=True)


def read_result(run: Launched):
    """The figures a launched worker printed (its last print_result line)."""
    lines = [line for line in run.output.splitlines() if line.startswith(RESULT_PREFIX)]
    if run.returncode != 0 or not lines:
        raise LaunchFailed(f"{' '.join(run.command)}: rc {run.returncode}, no result\n{run.tail()}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


# ---------------------------------------------------------------------------- timing
def alternate(calls: dict, rounds: int, warmup: int = 0, sync=None, clock=time.perf_counter) -> dict:
    """{name: [its seconds in each round]}: each call timed once per round, the calls taking
    turns, so that a slow moment of the machine falls on all of them alike; the first `warmup`
    rounds are not kept.
    sync: called before the clock starts and before it stops (a CUDA sync, a barrier), so that
    the time is the work's and not its queueing. clock: time.process_time for CPU time."""
    seconds = {name: [] for name in calls}
    for round_ in range(warmup + rounds):
        for name, call in calls.items():
            if sync:
                sync()
            start = clock()
            call()
            if sync:
                sync()
            if round_ >= warmup:
                seconds[name].append(clock() - start)
    return seconds


def median_seconds(call, rounds: int, warmup: int = 1, sync=None, clock=time.perf_counter) -> float:
    """The median seconds of `rounds` calls after `warmup` untimed ones (compiles, caches)."""
    return statistics.median(alternate({"call": call}, rounds, warmup, sync, clock)["call"])


# ---------------------------------------------------------------------------- command lines and tables
def subcommand_parser(doc: str, subcommands: dict, parser_class=argparse.ArgumentParser):
    """A benchmark's parser: one subcommand per entry of {name: (add_args, run)}, whose --help is
    add_args's docstring (its first line in the list), and whose `run` parse_args() returns."""
    raw = argparse.RawDescriptionHelpFormatter  # the docstrings' own line breaks: tables of variants
    parser = parser_class(description=doc, formatter_class=raw)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for name, (add_args, run) in subcommands.items():
        about = inspect.cleandoc(add_args.__doc__)
        add_args(sub.add_parser(name, help=about.split("\n")[0], description=about, formatter_class=raw))
        sub.choices[name].set_defaults(run=run)
    return parser


def table(*columns):
    """A benchmark's table, in Markdown, as the docs quote it: the header now, the rows as they come."""
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)


def row(*cells):
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)  # one at a time: a run cut short keeps its rows
