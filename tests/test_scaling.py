"""Growing past DDP: a fixed global batch that survives world-size changes, FSDP2
that trains like DDP, and DCP checkpoints that reload on a different world size."""
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launch_utils import (
    TINY, assert_bitwise_equal, latest_checkpoint, max_abs_diff, out_args, run_training,
)

STEPS = 6
# lr 5e-4: Adam's first updates are ~lr * sign(g), so float noise in near-zero
# gradients (another summation order) shows up scaled by lr; 5e-4 keeps that below
# the 1e-5 tolerance while the weights still move by ~1e-3.
BASE = [*TINY, "--learning_rate", "5e-4", "--max_steps", str(STEPS), "--save_interval", "3",
        "--global_batch_size", "8"]
KILL_AT_3 = {"MINIMIND_FAULT_AT_STEP": "3", "MINIMIND_FAULT_KIND": "kill", "MINIMIND_FAULT_RANK": "0"}


def _run(tmp_path, run_dir, nproc, extra=(), env=None, expect_ok=True):
    result = run_training(nproc, [*BASE, *out_args(run_dir), *extra], tmp_path,
                          launcher="python" if nproc == 1 else "torchrun", env=env)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-3000:]
    else:
        assert result.returncode != 0, "the injected kill did not stop the run"
    return result


def _interrupted_then_resumed(tmp_path, name, first_nproc, then_nproc, extra=()):
    run_dir = tmp_path / name
    _run(tmp_path, run_dir, first_nproc, extra, env=KILL_AT_3, expect_ok=False)
    assert latest_checkpoint(run_dir, suffix=_suffix(extra, first_nproc))["global_step"] == 3
    resumed = _run(tmp_path, run_dir, then_nproc, [*extra, "--from_resume", "1"])
    return run_dir, resumed


def _suffix(extra, nproc):
    return ".dcp" if "fsdp" in extra and nproc > 1 else ".pth"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    _run(tmp, tmp / "single", 1)
    return latest_checkpoint(tmp / "single")["model"]


def test_global_batch_derives_accumulation_from_world_size(tmp_path):
    result = _run(tmp_path, tmp_path / "ws2", 2, ["--max_steps", "1"])
    assert "world_size=2 micro_batch=4 accumulation=1 global_batch=8" in result.stdout
    result = _run(tmp_path, tmp_path / "ws1", 1, ["--max_steps", "1"])
    assert "world_size=1 micro_batch=4 accumulation=2 global_batch=8" in result.stdout


def test_global_batch_not_divisible_is_a_clear_error(tmp_path):
    result = run_training(2, [*BASE, *out_args(tmp_path / "bad"), "--global_batch_size", "12"], tmp_path)
    assert result.returncode != 0
    assert "--global_batch_size 12 is not a multiple of --batch_size 4 x 2 processes = 8" in result.stdout


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_continues_exactly(uninterrupted, tmp_path, first, then):
    run_dir, resumed = _interrupted_then_resumed(tmp_path, f"ws{first}to{then}", first, then)
    assert "resumed from" in resumed.stdout and "at step 3/6" in resumed.stdout
    final = latest_checkpoint(run_dir)
    assert final["global_step"] == STEPS and final["world_size"] == then
    assert max_abs_diff(final["model"], uninterrupted) <= 1e-5


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    _run(tmp, tmp / "ddp", 2)
    return latest_checkpoint(tmp / "ddp")["model"]


def test_fsdp_matches_ddp_step_for_step(ddp_run, tmp_path):
    _run(tmp_path, tmp_path / "fsdp", 2, ["--parallel", "fsdp"])
    assert (tmp_path / "fsdp" / "ckpt" / "pretrain_64_resume_step0000006.dcp").is_dir()
    fsdp = _full_weights_of_dcp(tmp_path, tmp_path / "fsdp")
    assert max_abs_diff(fsdp, ddp_run) <= 1e-5
    # The seed-format weights are gathered on rank 0 and hold every tensor.
    half = torch.load(tmp_path / "fsdp" / "out" / "pretrain_64.pth", weights_only=True)
    assert half.keys() == ddp_run.keys()
    assert max_abs_diff({k: v.float() for k, v in half.items()}, fsdp) <= 1e-3


def _full_weights_of_dcp(tmp_path, run_dir):
    """The fp32 model weights inside the newest sharded checkpoint of `run_dir`."""
    out = tmp_path / f"{run_dir.name}_full.pt"
    dcp_to_torch_save(run_dir / "ckpt" / "pretrain_64_resume.dcp", out)
    return torch.load(out, weights_only=True)["model"]


def test_fsdp_killed_and_resumed_matches_uninterrupted_fsdp(tmp_path):
    _run(tmp_path, tmp_path / "straight", 2, ["--parallel", "fsdp"])
    run_dir, _ = _interrupted_then_resumed(tmp_path, "killed", 2, 2, ["--parallel", "fsdp"])
    straight = _full_weights_of_dcp(tmp_path, tmp_path / "straight")
    resumed = _full_weights_of_dcp(tmp_path, run_dir)
    assert_bitwise_equal(straight, resumed)


def test_two_process_dcp_checkpoint_resumes_on_one_process(uninterrupted, tmp_path):
    run_dir, resumed = _interrupted_then_resumed(tmp_path, "dcp2to1", 2, 1, ["--parallel", "fsdp"])
    assert "pretrain_64_resume_step0000003.dcp at step 3/6" in resumed.stdout
    final = latest_checkpoint(run_dir)
    assert final["global_step"] == STEPS and final["world_size"] == 1
    assert max_abs_diff(final["model"], uninterrupted) <= 1e-5
