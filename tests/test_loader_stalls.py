"""DataLoader workers: the longest temp folder they can work in, and a worker that stops
delivering, or dies, ends its rank in one line instead of hanging it."""
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
from tests.support import REPO_ROOT
from trainer.data import (
    MAX_WORKER_TMPDIR, LoaderStalled, check_worker_tmpdir, delivered_batches, make_train_loader, make_val_loader,
)


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
    from tests.support.assertions import error_lines
    from tests.support.jobs import run_trainer
    from tests.support.run_outputs import out_args
    from tests.support.tiny import TINY
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



def test_a_validation_set_smaller_than_the_world_is_one_line_not_silence():
    # Each rank scores whole samples, none twice: 1 sample over 2 ranks would leave both with none,
    # and the run would validate nothing (or log a loss of 0) without a word.
    one = [(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))]
    for rank in (0, 1):
        with pytest.raises(UserError, match="holds 1 samples, fewer than the 2 processes.*--val_fraction"):
            make_val_loader(one, batch_size=2, eval_batches=1, rank=rank, world_size=2, pin_memory=False)
    assert [len(b[0]) for b in make_val_loader(one * 3, 2, 1, 1, 2, False)] == [1]  # samples 1 of 0, 1
