"""The fault plan (tests/fault_injection.py): the MINIMIND_FAULT_* environment, read once at
start-up, decides which rank misbehaves at which step, a restarted group runs clean, and a run
without it runs the trainer's own functions. And DataLoader workers: the longest temp folder
they can work in, and a worker that stops delivering ends the rank instead of hanging it. And
what the launched tests count as a worker's traceback. And a one-line stop's line in torchrun's
error file."""
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler, get_worker_info

from common.errors import UserError
from tests.assertions import worker_tracebacks
from scripts.dev.launching import REPO_ROOT
from tests.fault_injection import FaultPlan, fault_env as fault, install, install_from_env
from trainer.data import MAX_WORKER_TMPDIR, LoaderStalled, check_worker_tmpdir, delivered_batches, make_train_loader


def poisoned(plan, steps) -> list[bool]:
    """Whether the plan makes each step's loss NaN (the total and every part), through the loss
    install() wraps."""
    import trainer.step as step_module
    from model.model_minimind import MiniMindOutput

    undo, out = install(plan), []
    try:
        for step in range(steps):
            plan.before_step(step)
            total, parts = step_module.training_loss(MiniMindOutput(loss=torch.ones(()), aux_loss=torch.zeros(())), 2)
            nan = [math.isnan(t.item()) for t in (total, *parts.values())]
            assert len(set(nan)) == 1, nan
            out.append(nan[0])
    finally:
        undo()
    return out


def test_fault_plan_is_read_once_and_fires_only_where_planned(monkeypatch):
    """The plan is the environment at start-up: later changes do not move it."""
    environ = {**fault("nan", at=3, rank=1), "RANK": "1"}
    plan, other_rank = FaultPlan.from_env(environ), FaultPlan.from_env({**environ, "RANK": "0"})
    environ["MINIMIND_FAULT_AT_STEP"] = "5"
    assert poisoned(plan, 6) == [False, False, False, True, False, False]
    assert not any(poisoned(other_rank, 6))
    forever = FaultPlan.from_env({**fault("nan_forever", at=2, rank=1), "RANK": "1"})
    assert poisoned(forever, 5) == [False, False, True, True, True]
    restarted = FaultPlan.from_env({**fault("raise", at=0, rank=1), "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    restarted.before_step(0)  # a restarted group runs clean
    with pytest.raises(RuntimeError, match="rank 1 raises at step 2"):
        FaultPlan.from_env({**fault("raise", at=2, rank=1), "RANK": "1"}).before_step(2)


def test_faults_wrap_the_trainers_functions_only_where_planned_and_undo_restores_them():
    import trainer.loop as loop
    import trainer.step as step_module

    own = loop.set_lr, step_module.training_loss
    assert install_from_env({}) is None  # no plan: nothing wrapped
    undo = install_from_env(fault("raise", at=2))
    assert loop.set_lr is not own[0] and step_module.training_loss is not own[1]
    undo()
    assert (loop.set_lr, step_module.training_loss) == own


class Stalls(Dataset):
    """A dataset whose worker delivers nothing for 3 s, as a worker whose sending thread
    died delivers nothing at all."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(3)
        return torch.zeros(2)


def test_a_worker_that_stops_delivering_fails_the_rank_after_dist_timeout():
    loader = make_train_loader(Stalls(), SequentialSampler(range(4)), batch_size=1, num_workers=1, dist_timeout=0.5,
                               pin_memory=False)
    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.5 seconds"):
        next(iter(loader))
    with pytest.raises(LoaderStalled) as info:  # as the training loop reads it: one line naming the flag
        next(delivered_batches(loader, 0.5, rank=1))
    assert str(info.value).startswith("rank 1: no batch from its DataLoader worker within --dist_timeout 0.5 s")
    assert len(str(info.value).splitlines()) == 1


def test_a_stalled_worker_ends_a_real_run_in_one_line_naming_dist_timeout(tmp_path, monkeypatch):
    """End to end: the trainer, in-process, with one DataLoader worker that delivers the first
    batch and then stops. The run trains step 1, then ends with exit code 1 and the one line
    within about --dist_timeout (2 s: room for the first batch on a loaded machine), instead
    of waiting forever. The stall is injected into the forked worker by patching the dataset
    class here, in the parent it is forked from: no hook in the product."""
    import multiprocessing

    from dataset.packed_dataset import PackedPretrainDataset, write_meta
    from tests.assertions import error_lines
    from tests.jobs import run_trainer
    from tests.run_outputs import out_args
    from tests.tiny import TINY
    from trainer import loop

    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the stall reaches the worker through fork; this platform starts workers another way")
    data = tmp_path / "data.bin"
    np.full(4096, 9, dtype=np.uint16).tofile(data)
    write_meta(data, vocab_size=6400, num_tokens=4096, num_docs=1, bos_token_id=1, eos_token_id=2, tokenizer="hand-made")
    release = multiprocessing.Event()  # inherited by the worker: ends its stall once the run has failed
    read = PackedPretrainDataset.__getitem__
    served = [0]  # the worker's own count, after the fork

    def stalls_after_one_batch(self, index):
        if get_worker_info() is not None:
            served[0] += 1
            if served[0] > 4:  # --batch_size 4: the first batch goes out, the second does not
                release.wait(30)
        return read(self, index)

    def fail(*args, **kwargs):
        # The loader's shutdown gives a worker 5 s to finish before it kills it, and the stalled
        # one would use them all: let it go as the run gives up.
        release.set()
        real_fail(*args, **kwargs)

    real_fail = loop.fail
    monkeypatch.setattr(PackedPretrainDataset, "__getitem__", stalls_after_one_batch)
    monkeypatch.setattr(loop, "fail", fail)
    started = time.monotonic()
    result = run_trainer([*TINY, *out_args(tmp_path / "run"), "--data_path", str(data), "--max_steps", "4",
                          "--num_workers", "1", "--dist_timeout", "2"], tmp_path / "run", timeout=30)
    seconds = time.monotonic() - started
    assert result.returncode == 1 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert error_lines(result.stdout) == [
        "error: rank 0: no batch from its DataLoader worker within --dist_timeout 2 s (a worker that hangs, or waits "
        "on a slow file system): check the data's disk and the workers' memory, raise --dist_timeout, or pass "
        "--num_workers 0"], result.stdout[-3000:]
    assert "step 1/4" in result.stdout and "step 2/4" not in result.stdout, result.stdout[-3000:]
    assert seconds < 20, seconds  # well short of the worker's 30 s: the timeout ended the run


class Dies(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does


def test_a_worker_that_dies_is_one_line_naming_what_to_check():
    loader = make_train_loader(Dies(), SequentialSampler(range(4)), batch_size=1, num_workers=1, dist_timeout=30,
                               pin_memory=False)
    with pytest.raises(LoaderStalled, match=r"^rank 0: a DataLoader worker died \(DataLoader worker \(pid"):
        next(delivered_batches(loader, 30, rank=0))


def test_the_stalled_rank_itself_prints_the_line_and_exits_1(tmp_path):
    """A rank that is not rank 0 (nor a node's first) says its own problem: nobody else knows it."""
    code = f"""if True:
        import os, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        os.environ.update(RANK="1", LOCAL_RANK="1")
        from trainer.distributed import fail
        fail("rank 1: no batch from its DataLoader worker", code=1, this_rank_only=True)
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip() == "error: rank 1: no batch from its DataLoader worker"


def _bad_flag():
    from common.cli import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="train_pretrain.py")
    parser.add_argument("--max_steps", type=int)
    parser.parse_args(["--max_steps", "ten"])


def _script_user_error():
    from common.errors import DataError, report_user_errors

    @report_user_errors
    def main():
        raise DataError("corpus.jsonl:3: not JSON; fix that line")
    main()


def _stalled_rank(monkeypatch):
    from trainer.distributed import fail

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    fail("rank 1: no batch from its DataLoader worker", code=1, this_rank_only=True)


@pytest.mark.parametrize("stop", ["bad flag", "script", "stalled rank"])
def test_a_one_line_stop_gives_its_line_to_torchrun_s_report(tmp_path, monkeypatch, capsys, stop):
    """Under torchrun (TORCHELASTIC_ERROR_FILE set), the line goes to this worker's error file too,
    read here as torchrun reads it: its failure report then shows the line, not "<N/A>" (the lost
    peer's line, under a real torchrun: test_fault_tolerance.py)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    stops = {"bad flag": _bad_flag, "script": _script_user_error, "stalled rank": lambda: _stalled_rank(monkeypatch)}
    with pytest.raises(SystemExit):
        stops[stop]()
    [line] = capsys.readouterr().err.splitlines()
    assert "error: " in line
    assert ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file)).message == line


@pytest.mark.parametrize("extra, works", [(0, True), (1, False)])
def test_the_longest_temp_folder_allowed_is_the_longest_that_works(monkeypatch, extra, works):
    """check_worker_tmpdir's limit is exactly where multiprocessing's own sockets stop binding."""
    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        folder = os.path.join(base, "d" * (MAX_WORKER_TMPDIR + extra - len(base) - 1))
        os.mkdir(folder)
        bind = subprocess.run([sys.executable, "-c", "from multiprocessing.connection import Listener; "
                               "Listener(family='AF_UNIX').close()"], env={**os.environ, "TMPDIR": folder},
                              capture_output=True, text=True, timeout=60)
        assert (bind.returncode == 0) == works, bind.stderr
        monkeypatch.setattr(tempfile, "tempdir", folder)
        if works:
            check_worker_tmpdir(num_workers=1)
        else:
            assert "AF_UNIX path too long" in bind.stderr
            with pytest.raises(UserError, match=f"is {MAX_WORKER_TMPDIR + 1} bytes long"):
                check_worker_tmpdir(num_workers=1)
        check_worker_tmpdir(num_workers=0)  # no workers, no sockets: any length is fine


WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/repo/trainer/train_pretrain.py", line 10, in <module>
RuntimeError: boom"""
# What an elastic agent logged, and survived with rc 0, when the agent hosting the store left first.
AGENT_EXIT_BARRIER = """E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier. Elapsed: 0.01 seconds
E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):
E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008]   File "/venv/torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier"""
CHILD_FAILED_REPORT = """Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>"""


def test_a_worker_traceback_is_found_but_not_the_launchers_own():
    assert worker_tracebacks(f"step 1\n{WORKER_TRACEBACK}\n")[0].startswith("Traceback")
    assert worker_tracebacks(f"{AGENT_EXIT_BARRIER}\n{CHILD_FAILED_REPORT}\n") == []
    assert len(worker_tracebacks(f"{AGENT_EXIT_BARRIER}\n{WORKER_TRACEBACK}\n")) == 1
