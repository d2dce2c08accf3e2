"""DDP must be an implementation detail: the same samples give the same update."""
import subprocess

import pytest
import torch

from tests.launch_utils import PYTHON, REPO_ROOT, TORCHRUN, free_port, max_abs_diff, run_env

WORKER = str(REPO_ROOT / "tests" / "ddp_step_worker.py")


def _step(tmp_path, name, nproc, batch, accum):
    out = tmp_path / f"{name}.pt"
    launcher = [PYTHON] if nproc == 1 else [*TORCHRUN, f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    result = subprocess.run([*launcher, WORKER, str(out), str(batch), str(accum)], env=run_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _step(tmp_path_factory.mktemp("ddp"), "ddp", nproc=2, batch=4, accum=1)


def test_two_ranks_equal_one_process_with_double_batch(ddp, tmp_path):
    single = _step(tmp_path, "single", nproc=1, batch=8, accum=1)
    assert max_abs_diff(ddp["weights"], single["weights"]) <= 1e-6
    assert abs(ddp["loss"] - single["loss"]) <= 1e-6


def test_two_ranks_equal_one_process_with_accumulation(ddp, tmp_path):
    accumulated = _step(tmp_path, "accum", nproc=1, batch=4, accum=2)
    assert max_abs_diff(ddp["weights"], accumulated["weights"]) <= 1e-6
    assert abs(ddp["loss"] - accumulated["loss"]) <= 1e-6


def test_the_update_is_not_trivially_equal(ddp, tmp_path):
    """Guard the comparison itself: a different batch must move the weights measurably."""
    other = _step(tmp_path, "half", nproc=1, batch=4, accum=1)
    assert max_abs_diff(ddp["weights"], other["weights"]) > 1e-4
