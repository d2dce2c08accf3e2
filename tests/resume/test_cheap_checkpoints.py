"""What keeps a save cheap: the sha256 is taken while the file is written, the finiteness
check reads the device once, and time-based saves follow rank 0's clock on every rank."""
import hashlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.host_reads import CountHostReads
from common.storage import atomic_torch_save
from trainer.distributed import weights_finite
from trainer.loop import SaveClock


def test_the_record_hashed_while_writing_is_the_file_on_disk(tmp_path):
    path = tmp_path / "ckpt.pth"
    state = {"model": {"w": torch.randn(300, 500), "b": torch.zeros(7)}, "step": torch.tensor(3), "note": "x"}
    record = atomic_torch_save(state, str(path))
    data = path.read_bytes()
    assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not os.path.exists(f"{path}.tmp")
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), -float("inf")])
def test_weights_finite_is_one_host_read_for_any_number_of_parameters(poison):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])  # 40 parameters
    if poison is not None:
        with torch.no_grad():
            model[13].bias[5] = poison
    with CountHostReads() as reads:
        finite = weights_finite(model)
    assert finite == (poison is None)
    assert reads.reads == 1


def test_a_huge_but_finite_weight_is_finite():
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(3e38)  # its 2-norm would overflow to inf; the max does not
    assert weights_finite(model)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_save_clock_asks_every_minutes_on_rank_0_only():
    clock = FakeClock()
    saves = SaveClock(1.0, is_main=True, clock=clock)
    clock.now = 59.0
    assert not saves.due()  # a minute has not passed
    clock.now = 61.0
    assert saves.due()
    saves.saved()
    clock.now = 100.0
    assert not saves.due()  # 39 s since that save
    assert not SaveClock(0, is_main=True, clock=clock).due()  # no --save_every_minutes: steps only
    clock.now = 1e6
    assert not SaveClock(1.0, is_main=False, clock=clock).due()


def _schedule_worker(rank, tmp_dir):
    """Two ranks, each with its own clock, run the step's agreement on what each asked."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/init", rank=rank, world_size=2)
    clock = FakeClock()
    saves = SaveClock(1.0, is_main=rank == 0, clock=clock)
    answers = []
    # Rank 1's clock says a minute passed long before rank 0's does: rank 0 decides.
    for t0, t1 in [(10, 70), (30, 500), (61, 0), (62, 62)]:
        clock.now = t0 if rank == 0 else t1
        asked = torch.tensor(float(saves.due()))
        dist.all_reduce(asked)  # what trainer/step.py's flags tensor carries, with the rest
        answers.append(bool(asked.item()))
    torch.save(answers, f"{tmp_dir}/answers{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_follows_rank_0s_clock(tmp_path):
    # fork: the workers need nothing but what this process has already imported
    mp.start_processes(_schedule_worker, args=(str(tmp_path),), nprocs=2, join=True, start_method="fork")
    answers = [torch.load(tmp_path / f"answers{rank}.pt") for rank in (0, 1)]
    assert answers[0] == answers[1] == [False, False, True, True]
