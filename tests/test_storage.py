"""A full or failing disk costs one line, never a run (docs/fault-tolerance.md): every write of
the trainer that the disk refuses becomes one line naming what, where, why and the free space; a
failed save leaves nothing behind and stops the run; after the space returns the resume is
bitwise the uninterrupted run; start-up removes what a killed save left and warns of a disk too
small; a checkpoint the disk cannot read is skipped like a corrupt one. The scripts' writes are
tests/test_storage_scripts.py's.

The disk is tests/support/fault_injection.py's SmallDisk (conftest.py's small_disk fixture): a
tmpfs where the tests may mount one, else a folder whose writes a quota refuses past its size."""
import errno
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.errors import StorageError
from common.storage import atomic_torch_save
from tests.support.assertions import assert_bitwise_equal, assert_same_state, error_lines, worker_tracebacks
from tests.support.fault_injection import MiB, size_of
from tests.support.jobs import run_trainer
from tests.support.run_outputs import PREFIX, checkpoint_name, latest_link_name, load_checkpoint, out_args
from tests.support.tiny import TINY
from trainer.checkpoint import verify_checkpoint

RUN = [*TINY, "--max_steps", "6", "--save_interval", "2"]


def final_state(checkpoint_dir: Path, step: int, sharded=False, prefix=PREFIX) -> dict:
    path = checkpoint_dir / checkpoint_name(step, prefix, sharded)
    if sharded:
        dcp_to_torch_save(path, checkpoint_dir.parent / "whole.pt")
        path = checkpoint_dir.parent / "whole.pt"
    return load_checkpoint(path)


def assert_same_run(a: dict, b: dict):
    assert_bitwise_equal(a["model"], b["model"])
    assert_same_state(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer state")


# ---------------------------------------------------------------------------- one write
def test_a_write_the_disk_refuses_is_one_line_and_leaves_the_old_file(small_disk):
    disk = small_disk(4 * MiB)
    target = disk.path / "weights.pth"
    atomic_torch_save({"w": torch.zeros(1000)}, target)
    before = target.read_bytes()
    disk.fill(leave=MiB // 2)
    with pytest.raises(StorageError) as info, disk.installed():
        atomic_torch_save({"w": torch.zeros(MiB)}, target, "the weights", "pass another folder")  # 4 MiB
    line = str(info.value)
    assert re.fullmatch(rf"cannot write the weights {target}: no space left on device \([\d.,]+ KiB free there, "
                        rf"4\.0 MiB needed\); free space there or pass another folder", line), line
    assert target.read_bytes() == before and sorted(p.name for p in disk.path.iterdir()) == ["ballast", "weights.pth"]


def test_the_metrics_file_on_a_full_disk_costs_a_warning_not_the_run(tmp_path, small_disk, capsys):
    """The metrics file only repeats the log lines: a disk that refuses it is said once, and the
    run goes on (a save to that disk would stop it: the next test)."""
    from trainer.loop import TrainClock
    from trainer.metrics import RunLogger
    from trainer.train_state import StepPlan, TrainState

    disk = small_disk(MiB)
    state = TrainState(StepPlan(4, 1, 1, 100, 100))
    output = type("Output", (), {"save_dir": str(disk.path), "from_resume": 0, "use_wandb": False})
    with disk.installed():
        log = RunLogger(str(disk.path / "metrics.jsonl"), output, PREFIX, state, {}, True, TrainClock())
        disk.fill(leave=0)
        for step in (1, 2):
            log.log_train(step, 0, {"loss": 5.0, "aux_loss": 0.0}, {"decay": 1e-3}, 100 * step, 1000.0, 900.0, None)
    out = capsys.readouterr().out
    assert out.count("warning: cannot write the metrics") == 1 and "training goes on" in out
    assert out.count("epoch 1/1 step") == 2  # the log lines, every one


# ---------------------------------------------------------------------------- a run whose disk fills
def disk_run(tmp_path, disk, flags, nproc=1, mode="inprocess", sharded=False, script=None, prefix=PREFIX,
             ref_mode=None):
    """A reference run on a roomy disk (launched as `ref_mode`, else `mode`), then the same run with
    --checkpoint_dir on `disk`, left with room for one and a half checkpoints: the save at step 2
    fits, the one at step 4 does not. Returns (the reference's final state, the failed run, its
    flags of where, the script's)."""
    extra = {"script": script} if script else {}
    ref = run_trainer([*flags, *out_args(tmp_path / "ref")], tmp_path / "ref", nproc=nproc, mode=ref_mode or mode,
                      **extra)
    assert ref.returncode == 0, ref.stdout[-3000:]
    size = size_of(tmp_path / "ref" / "ckpt" / checkpoint_name(2, prefix, sharded))
    disk.fill(leave=int(1.5 * size))
    where = ["--save_dir", str(tmp_path / "run" / "out"), "--checkpoint_dir", str(disk.path)]
    full = run_trainer([*flags, *where], tmp_path / "run", nproc=nproc, mode=mode, env=disk.env, **extra)
    return final_state(tmp_path / "ref" / "ckpt", 6, sharded, prefix), full, where, extra


def assert_stopped_in_one_line_with_step_2_intact(full, disk, sharded=False, prefix=PREFIX):
    assert full.returncode not in (0, None), full.stdout[-3000:]
    lines = error_lines(full.stdout)
    assert lines and all(line == lines[0] for line in lines), lines  # every rank that speaks says the same
    assert re.match(rf"error: cannot write the checkpoint('s shards)? {disk.path}/{prefix}_resume_step0000004\.", lines[0])
    assert "no space left on device" in lines[0] and "free there" in lines[0] and "--from_resume 1" in lines[0]
    assert not worker_tracebacks(full.stdout), worker_tracebacks(full.stdout)[0]  # torchrun's own report aside
    step2 = checkpoint_name(2, prefix, sharded)
    assert sorted(p.name for p in disk.path.iterdir()) == sorted(["ballast", step2, f"{step2}.json",
                                                                   latest_link_name(prefix, sharded)])
    assert os.readlink(disk.path / latest_link_name(prefix, sharded)) == step2
    verify_checkpoint(str(disk.path / step2))


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["one process", "torchrun", "fsdp", "sft"])
def test_a_disk_that_fills_stops_the_run_in_one_line_and_the_resume_is_bitwise(tmp_path, small_disk, launch):
    """One process, 2 DDP processes under torchrun (whose failure report names our line), 2 FSDP
    processes (every rank's shards in a .dcp folder), and fine-tuning: the save at step 4 does
    not fit, the run stops with one line, step 2's checkpoint and link stay as they were; with
    the space back, --from_resume 1 ends bitwise where the uninterrupted run ends."""
    nproc, mode, flags, script, sharded, prefix = 1, "inprocess", RUN, None, False, PREFIX
    ref_mode = None
    if launch == "torchrun":  # the disk fills under the real torchrun; the rest forked, which trains the same bits
        nproc, mode, ref_mode = 2, "torchrun", "forked"
    elif launch == "fsdp":
        nproc, mode, flags, sharded = 2, "forked", [*RUN, "--parallel", "fsdp"], True
    elif launch == "sft":
        from scripts.dev.launching import TRAIN_SFT

        flags, script, prefix = [*RUN, "--from_weight", "none", "--max_seq_len", "128"], TRAIN_SFT, "full_sft_64"
    disk = small_disk(40 * MiB)
    reference, full, where, extra = disk_run(tmp_path, disk, flags, nproc, mode, sharded, script, prefix, ref_mode)
    assert_stopped_in_one_line_with_step_2_intact(full, disk, sharded, prefix)
    if launch == "one process":
        assert re.search(r"warning: --checkpoint_dir \S+ has [\d.,]+ \w+ free .* needs about [\d.,]+ \w+", full.stdout)
    if launch == "torchrun":  # torchrun's own report names the root cause in our words, not a traceback
        assert re.search(r"(?m)^\s*traceback\s*: error: cannot write the checkpoint", full.stdout), full.stdout[-2000:]
    disk.empty()
    resumed = run_trainer([*flags, *where, "--from_resume", "1"], tmp_path / "run", nproc=nproc,
                          mode=ref_mode or mode, env=disk.env, **extra)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2/6" in resumed.stdout
    assert_same_run(final_state(disk.path, 6, sharded, prefix), reference)


@pytest.mark.slow
def test_a_full_disk_under_the_weights_stops_the_save_and_keeps_the_checkpoint_before(tmp_path, small_disk):
    """--save_dir on the small disk: the inference weights of step 4 do not fit; the checkpoint of
    step 4 that was written goes again, and step 2's is the newest."""
    disk = small_disk(16 * MiB)
    ckpt = tmp_path / "ckpt"
    first = run_trainer([*RUN, "--max_steps", "2", "--save_dir", str(disk.path), "--checkpoint_dir", str(ckpt)],
                        tmp_path, env=disk.env)
    assert first.returncode == 0, first.stdout[-3000:]
    disk.fill(leave=size_of(disk.path / f"{PREFIX}.pth") // 2)
    full = run_trainer([*RUN, "--save_dir", str(disk.path), "--checkpoint_dir", str(ckpt), "--from_resume", "1"],
                       tmp_path, env=disk.env)
    assert full.returncode == 2 and "Traceback" not in full.stdout, full.stdout[-3000:]
    [line] = error_lines(full.stdout)
    assert line.startswith(f"error: cannot write the weights {disk.path}/{PREFIX}.pth: no space left on device")
    assert sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".pth")) == sorted([checkpoint_name(2),
                                                                                          latest_link_name()])
    assert not [p for p in disk.path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------- start-up and reads
def test_start_up_removes_what_a_killed_save_left_and_only_this_runs(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    leftovers = [ckpt / f"{checkpoint_name(4)}.tmp", ckpt / f"{checkpoint_name(4)}.json.tmp",
                 ckpt / f"{latest_link_name()}.tmp", out / f"{PREFIX}.pth.tmp"]
    (ckpt / f"{checkpoint_name(4, sharded=True)}.tmp").mkdir()  # a half .dcp folder
    leftovers.append(ckpt / f"{checkpoint_name(4, sharded=True)}.tmp")
    other_run = ckpt / "pretrain_128_resume_step0000004.pth.tmp"  # another run's save, maybe under way
    for path in [*leftovers[:-1], other_run]:
        path.write_bytes(b"half")
    run = run_trainer([*TINY, "--max_steps", "1", *out_args(tmp_path)], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    for path in leftovers:
        assert not path.exists() and f"removed {path}, left by a save that did not finish" in run.stdout
    assert other_run.exists()


def test_a_newest_checkpoint_the_disk_cannot_read_gives_way_to_the_one_before(tmp_path, monkeypatch):
    import builtins

    first = run_trainer([*RUN, "--max_steps", "4", *out_args(tmp_path)], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    unreadable = str(tmp_path / "ckpt" / checkpoint_name(4))
    real_open = builtins.open

    def failing_open(file, *args, **kwargs):
        if str(file) == unreadable:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", failing_open)
    resumed = run_trainer([*RUN, *out_args(tmp_path), "--from_resume", "1"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("skipping checkpoint")]
    assert skipped == [f"skipping checkpoint {unreadable}: cannot be read (Input/output error)"]
    assert f"resumed from {tmp_path / 'ckpt' / checkpoint_name(2)} at step 2/6" in resumed.stdout
