"""--profile_steps writes a torch.profiler trace of rank 0 that Perfetto and TensorBoard open;
--memory_snapshot writes the CUDA allocator's state, also on out-of-memory (its CUDA calls
stood in for on CPU)."""
import gzip
import json
import pytest
import torch

from tests.support.jobs import run_trainer
from tests.support.run_outputs import out_args
from tests.support.tiny import TINY
from trainer.metrics import Profiling


def trace_events(path) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def test_profile_steps_writes_a_chrome_trace_of_those_steps(tmp_path):
    run = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "5", "--profile_steps", "2:3"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    traces = list((tmp_path / "out" / "profile").iterdir())
    assert [p.name for p in traces] == ["pretrain_64_steps2-3_rank0.pt.trace.json.gz"]  # TensorBoard's naming
    assert f"traced in {traces[0]}" in run.stdout
    names = {event.get("name") for event in trace_events(traces[0])}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert "aten::mm" in names and "aten::baddbmm" in names  # the model's matmuls, Muon's batched iteration


@pytest.mark.slow
def test_two_processes_write_rank_0s_trace_up_to_the_runs_end(tmp_path):
    run = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "3", "--profile_steps", "3:9"], tmp_path, nproc=2,
                      mode="forked")
    assert run.returncode == 0, run.stdout[-3000:]
    traces = sorted(p.name for p in (tmp_path / "out" / "profile").iterdir())
    assert traces == ["pretrain_64_steps3-3_rank0.pt.trace.json.gz"]  # the window ends with the run
    assert "ProfilerStep#3" in {e.get("name") for e in trace_events(tmp_path / "out" / "profile" / traces[0])}


def test_a_window_already_trained_says_so(tmp_path):
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        profiling = Profiling(str(tmp_path / "profile"), "run", 0, torch.device("cpu"), (2, 3), False, start_step=10,
                              total_steps=20)
    assert "already trained" in out.getvalue()
    for step in range(11, 14):
        profiling.step_begins(step)
        profiling.step_ended(step)
    assert not tmp_path.joinpath("profile").exists()


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """torch.cuda.memory's recorder on a CPU machine: records the calls, writes a file per dump."""
    calls = []

    def record(enabled="all", **kwargs):
        calls.append(("record", enabled))

    def dump(path):
        calls.append(("dump", path))
        with open(path, "wb") as f:
            f.write(b"snapshot")
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def test_memory_snapshot_records_the_first_steps_then_stops(tmp_path, fake_cuda_memory):
    profiling = Profiling(str(tmp_path / "profile"), "run", 0, torch.device("cuda", 0), None, True, start_step=0,
                          total_steps=100)
    for step in range(1, 6):
        profiling.step_begins(step)
        profiling.step_ended(step)
    path = str(tmp_path / "profile" / "run_memory_rank0.pickle")
    assert fake_cuda_memory == [("record", "all"), ("dump", path), ("record", None)]


def test_out_of_memory_writes_a_snapshot_and_still_fails(tmp_path, fake_cuda_memory):
    profiling = Profiling(str(tmp_path / "profile"), "run", 1, torch.device("cuda", 1), None, True, start_step=0,
                          total_steps=100)
    with pytest.raises(torch.OutOfMemoryError):
        with profiling.running(lambda: 6):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert (tmp_path / "profile" / "run_memory_oom_step7_rank1.pickle").read_bytes() == b"snapshot"


def test_memory_snapshot_on_cpu_is_one_line(tmp_path):
    run = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "2", "--memory_snapshot", "1"], tmp_path)
    assert run.returncode == 2
    assert "error: --memory_snapshot 1 records CUDA allocations, and this run is on the CPU" in run.stdout
    assert "Traceback" not in run.stdout


def test_a_run_that_stops_inside_the_window_writes_what_it_traced(tmp_path):
    """A preempted, failed or resumed run traces the steps it really ran, named by them."""
    profiling = Profiling(str(tmp_path / "profile"), "run", 0, torch.device("cpu"), (2, 6), False, start_step=2,
                          total_steps=20)  # resumed at 2
    done = 2
    with pytest.raises(KeyboardInterrupt):
        with profiling.running(lambda: done):
            for step in (3, 4):
                profiling.step_begins(step)
                torch.ones(4).add_(1)
                profiling.step_ended(step)
                done = step
            raise KeyboardInterrupt  # stopped during step 5
    names = {e.get("name") for e in trace_events(tmp_path / "profile" / "run_steps3-4_rank0.pt.trace.json.gz")}
    # Steps 3 and 4, and the start of step 5, where it stopped.
    assert {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"} <= names and "ProfilerStep#6" not in names


def test_the_run_s_own_error_survives_a_profile_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    """Stopped inside its first traced step, with the trace unwritable (say, a full disk): the
    error that stopped the run is the one that goes on up, and a line says what was lost."""
    from common.errors import UserError

    profiling = Profiling(str(tmp_path / "profile"), "run", 0, torch.device("cpu"), (3, 6), False, start_step=0,
                          total_steps=20)
    names = []

    def unwritable(name):
        names.append(name)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(profiling, "_path", unwritable)
    with pytest.raises(UserError, match="the run's own"):
        with profiling.running(lambda: 2):
            profiling.step_begins(3)
            raise UserError("the run's own error")
    assert names == ["steps3-3_rank0.pt.trace.json.gz"]  # not steps3-2: the part of step 3 it ran
    assert "profile: could not write the profile of a failed run" in capsys.readouterr().out
