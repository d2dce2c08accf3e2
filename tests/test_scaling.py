"""Growing past DDP: a fixed global batch that survives world-size changes, FSDP2
that trains like DDP, and DCP checkpoints that reload on a different world size."""
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.support.assertions import assert_bitwise_equal, assert_clean_exit, max_abs_diff
from tests.support.jobs import JobSpec, run_all
from tests.support.run_outputs import checkpoint_name, latest_checkpoint, latest_link, out_args
from tests.support.tiny import TINY
from tests.support.fault_injection import fault_env

# 20 steps with the default optimizer (Muon on the blocks, AdamW on the rest), killed at
# step 13 and resumed from the step-10 checkpoint. AdamW's lr 5e-4: Adam's first updates are
# ~lr * sign(g), so float noise in near-zero gradients (another summation order) shows up
# scaled by lr; 5e-4 keeps that below the 1e-5 tolerance while the weights still move by ~1e-3.
STEPS, SAVE, KILL = 20, 10, 13
BASE = [*TINY, "--learning_rate", "5e-4", "--max_steps", str(STEPS), "--save_interval", str(SAVE),
        "--global_batch_size", "8"]
KILLED = fault_env("kill", at=KILL, rank=0)


# name: (processes of the killed run, processes of its resume, extra flags)
INTERRUPTED = {"ws2to1": (2, 1, []), "ws1to2": (1, 2, []), "fsdp_killed": (2, 2, ["--parallel", "fsdp"]),
               "dcp2to1": (2, 1, ["--parallel", "fsdp"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, two at a time: first those that need no other run (the
    uninterrupted ones and the killed ones), then the resumes of the killed ones.
    dcp2to1 resumes a copy of fsdp_killed's folder, which is the same 2-process FSDP
    run killed at the same step. {name: (run_dir, Finished)}, and for an interrupted
    run also name + "/killed" and the step of its checkpoint after the kill. The ranks
    are forked from the preloaded trainer (tests/support/forked_ranks.py): these tests are about
    the trainer's state across world sizes and DDP/FSDP, not about the launcher."""
    root = tmp_path_factory.mktemp("scaling")
    first = {
        # The 1-process jobs first: two of them share the two cores best.
        "single": JobSpec([*BASE, *out_args(root / "single")], root / "single", nproc=1, mode="forked"),
        "ws1to2/killed": JobSpec([*BASE, *out_args(root / "ws1to2")], root / "ws1to2", nproc=1, mode="forked",
                                 env=KILLED),
        "ddp": JobSpec([*BASE, *out_args(root / "ddp")], root / "ddp", nproc=2, mode="forked"),
        "fsdp": JobSpec([*BASE, *out_args(root / "fsdp"), "--parallel", "fsdp"], root / "fsdp", nproc=2, mode="forked"),
        "bad_batch": JobSpec([*BASE, *out_args(root / "bad"), "--global_batch_size", "12"], root / "bad", nproc=2,
                             mode="forked"),
        "ws2to1/killed": JobSpec([*BASE, *out_args(root / "ws2to1")], root / "ws2to1", nproc=2, mode="forked",
                                 env=KILLED),
        "fsdp_killed/killed": JobSpec([*BASE, *out_args(root / "fsdp_killed"), "--parallel", "fsdp"],
                                      root / "fsdp_killed", nproc=2, mode="forked", env=KILLED),
    }
    done = {name: (first[name].run_dir, result) for name, result in run_all(first, timeout=240).items()}
    shutil.copytree(root / "fsdp_killed", root / "dcp2to1", symlinks=True)
    done["dcp2to1/killed"] = done["fsdp_killed/killed"]
    resumes = {}
    for name, (killed_nproc, nproc, extra) in INTERRUPTED.items():
        saved = latest_link(root / name, sharded=_suffix(extra, killed_nproc) == ".dcp")
        done[f"{name}/step"] = saved.exists() and latest_checkpoint(root / name, suffix=saved.suffix)["global_step"]
        resumes[name] = JobSpec([*BASE, *out_args(root / name), *extra, "--from_resume", "1"], root / name, nproc=nproc,
                                mode="forked")
    done.update({name: (resumes[name].run_dir, result) for name, result in run_all(resumes, timeout=240).items()})
    return done


def _ok(runs, name):
    run_dir, result = runs[name]
    assert_clean_exit(result.returncode, result.stdout, name)
    return run_dir, result


def _interrupted_then_resumed(runs, name):
    assert runs[f"{name}/killed"][1].returncode != 0, "the injected kill did not stop the run"
    assert runs[f"{name}/step"] == SAVE
    return _ok(runs, name)


def _suffix(extra, nproc):
    return ".dcp" if "fsdp" in extra and nproc > 1 else ".pth"


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return latest_checkpoint(_ok(runs, "single")[0])["model"]


@pytest.mark.slow
def test_global_batch_derives_accumulation_from_world_size(runs):
    assert "world_size=2 micro_batch=4 accumulation=1 global_batch=8" in _ok(runs, "ddp")[1].stdout
    assert "world_size=1 micro_batch=4 accumulation=2 global_batch=8" in _ok(runs, "single")[1].stdout


@pytest.mark.slow
def test_global_batch_not_divisible_is_a_clear_error(runs):
    result = runs["bad_batch"][1]
    assert result.returncode != 0
    assert "--global_batch_size 12 is not a multiple of --batch_size 4 x 2 processes = 8" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_continues_exactly(uninterrupted, runs, first, then):
    run_dir, resumed = _interrupted_then_resumed(runs, f"ws{first}to{then}")
    assert "resumed from" in resumed.stdout and f"at step {SAVE}/{STEPS}" in resumed.stdout
    final = latest_checkpoint(run_dir)
    assert final["global_step"] == STEPS and final["world_size"] == then
    diff = max_abs_diff(final["model"], uninterrupted)
    print(f"\n{first} -> {then} processes, {STEPS} steps: max |w - uninterrupted| = {diff:.2e}")  # docs/clusters.md
    assert diff <= 1e-5


@pytest.fixture(scope="module")
def ddp_run(runs):
    return latest_checkpoint(_ok(runs, "ddp")[0])["model"]


@pytest.mark.slow
def test_fsdp_matches_ddp_step_for_step(ddp_run, runs, tmp_path):
    fsdp_dir = _ok(runs, "fsdp")[0]
    assert (fsdp_dir / "ckpt" / checkpoint_name(STEPS, sharded=True)).is_dir()
    fsdp = _full_weights_of_dcp(tmp_path, fsdp_dir)
    diff = max_abs_diff(fsdp, ddp_run)
    print(f"\nFSDP against DDP, {STEPS} steps: max |w_fsdp - w_ddp| = {diff:.2e}")  # docs/clusters.md
    assert diff <= 1e-5
    # MiniMind-format weights are gathered on rank 0 and hold every tensor.
    half = torch.load(fsdp_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert half.keys() == ddp_run.keys()
    assert max_abs_diff({k: v.float() for k, v in half.items()}, fsdp) <= 1e-3


def _full_weights_of_dcp(tmp_path, run_dir):
    """The fp32 model weights inside the newest sharded checkpoint of `run_dir`."""
    out = tmp_path / f"{run_dir.name}_full.pt"
    dcp_to_torch_save(latest_link(run_dir, sharded=True), out)
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.slow
def test_fsdp_killed_and_resumed_matches_uninterrupted_fsdp(runs, tmp_path):
    run_dir, _ = _interrupted_then_resumed(runs, "fsdp_killed")
    straight = _full_weights_of_dcp(tmp_path, _ok(runs, "fsdp")[0])
    resumed = _full_weights_of_dcp(tmp_path, run_dir)
    assert_bitwise_equal(straight, resumed)


@pytest.mark.slow
def test_two_process_dcp_checkpoint_resumes_on_one_process(uninterrupted, runs):
    run_dir, resumed = _interrupted_then_resumed(runs, "dcp2to1")
    assert f"{checkpoint_name(SAVE, sharded=True)} at step {SAVE}/{STEPS}" in resumed.stdout
    final = latest_checkpoint(run_dir)
    assert final["global_step"] == STEPS and final["world_size"] == 1
    assert max_abs_diff(final["model"], uninterrupted) <= 1e-5
