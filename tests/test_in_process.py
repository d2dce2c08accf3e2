"""The in-process runner the quick tests train with: it gives back the exit code and
output, puts the process's globals back, and turns a hang into a failed run."""
import os
import signal
import sys
import time

import torch

from tests.support.jobs import run_in_process


def test_exit_code_output_and_globals_are_put_back(tmp_path):
    handler, threads, cwd = signal.getsignal(signal.SIGTERM), torch.get_num_threads(), os.getcwd()

    def fn():
        signal.signal(signal.SIGTERM, lambda *_: None)
        os.environ["MINIMIND_TEST_VAR"] = "set"
        print("to stdout")
        print("to stderr", file=sys.stderr)
        assert torch.get_num_threads() == 1 and os.getcwd() == str(tmp_path / "run")
        sys.exit(3)

    done = run_in_process(fn, tmp_path / "run")
    assert done.returncode == 3
    assert "to stdout" in done.stdout and "to stderr" in done.stdout
    assert signal.getsignal(signal.SIGTERM) is handler
    assert "MINIMIND_TEST_VAR" not in os.environ
    assert (torch.get_num_threads(), os.getcwd()) == (threads, cwd)


def test_a_hang_ends_with_code_1_after_the_timeout(tmp_path):
    alarm_handler, start = signal.getsignal(signal.SIGALRM), time.monotonic()
    done = run_in_process(lambda: time.sleep(30), tmp_path, timeout=1)
    assert done.returncode == 1
    assert "InProcessTimeout" in done.stdout
    assert time.monotonic() - start < 10
    assert signal.getsignal(signal.SIGALRM) is alarm_handler
