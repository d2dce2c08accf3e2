"""The 2-process job must exit 0 every time. gloo can SIGABRT at exit ("terminate
called without an active exception") when a DDP model is still alive at
destroy_process_group; the trainer's cleanup drops it first. One lucky run proves
little, so the tiny job runs 10 times, two jobs at a time (start-up is most of a
run and each job keeps about one core busy)."""
import pytest

from tests.launch_utils import TINY, ensure_demo_corpus, latest_checkpoint, out_args, start_training

RUNS, AT_ONCE = 10, 2
ABORT_SIGNS = ("terminate called", "SIGABRT")  # gloo's abort at exit, as the worker or torchrun reports it


@pytest.mark.slow
def test_two_process_job_exits_cleanly_every_time(tmp_path):
    ensure_demo_corpus()
    failures = []
    for first in range(0, RUNS, AT_ONCE):
        jobs = []
        for i in range(first, min(first + AT_ONCE, RUNS)):
            run_dir = tmp_path / f"run{i}"
            run_dir.mkdir()
            jobs.append((i, run_dir, start_training(2, [*TINY, *out_args(run_dir), "--max_steps", "3"], run_dir)))
        for i, run_dir, proc in jobs:
            try:
                output = proc.communicate(timeout=240)[0]
            except BaseException:
                for _, _, other in jobs:
                    other.kill()
                    other.wait()
                raise
            signs = [sign for sign in ABORT_SIGNS if sign in output]
            if proc.returncode != 0 or signs:
                failures.append(f"run {i}: rc {proc.returncode}, {signs}\n{output[-2000:]}")
            else:
                assert latest_checkpoint(run_dir)["global_step"] == 3
    assert not failures, f"{len(failures)}/{RUNS} runs did not exit cleanly:\n" + "\n".join(failures)
