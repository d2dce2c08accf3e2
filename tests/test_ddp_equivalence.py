"""DDP must be an implementation detail: the same samples give the same update."""
import pytest
import torch

from tests.support.assertions import assert_clean_exit, max_abs_diff
from tests.support import REPO_ROOT
from tests.support.jobs import JobSpec, run_all

WORKER = REPO_ROOT / "tests" / "support" / "ddp_step_worker.py"
# name: (processes, batch per process, accumulation steps)
STEPS = {"ddp": (2, 4, 1), "single": (1, 8, 1), "accum": (1, 4, 2), "half": (1, 4, 1)}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One optimizer step of each kind, two jobs at a time, each rank a process forked from
    the preloaded trainer (tests/support/forked_ranks.py): {name: {"weights", "loss"}}."""
    root = tmp_path_factory.mktemp("steps")
    jobs = {name: JobSpec([root / f"{name}.pt", batch, accum], root / name, nproc, "forked", script=WORKER)
            for name, (nproc, batch, accum) in STEPS.items()}
    for name, result in run_all(jobs, timeout=120).items():
        assert_clean_exit(result.returncode, result.stdout, name)
    return {name: torch.load(root / f"{name}.pt", weights_only=True) for name in STEPS}


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_double_batch(steps):
    ddp, single = steps["ddp"], steps["single"]
    assert max_abs_diff(ddp["weights"], single["weights"]) <= 1e-6
    assert abs(ddp["loss"] - single["loss"]) <= 1e-6


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_accumulation(steps):
    ddp, accumulated = steps["ddp"], steps["accum"]
    assert max_abs_diff(ddp["weights"], accumulated["weights"]) <= 1e-6
    assert abs(ddp["loss"] - accumulated["loss"]) <= 1e-6


@pytest.mark.slow
def test_the_update_is_not_trivially_equal(steps):
    """Guard the comparison itself: a different batch must move the weights measurably."""
    ddp, other = steps["ddp"], steps["half"]
    assert max_abs_diff(ddp["weights"], other["weights"]) > 1e-4
