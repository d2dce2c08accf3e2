"""Which checkpoint a resume takes: the newest that verifies, each skipped one said in a line; a
record of the wrong shape or a part left out is skipped like a damaged file; none usable stops the
run; a skipped newest whose record gave the run its config stops a resume of another run; no
checkpoint starts fresh, but one of another shape is named. CheckpointManager in this process,
over tests/support/checkpoints.py's stand-in parts."""
import json
import os
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from tests.support.checkpoints import CONFIG, PREFIX, FakeModel, manager, plan, save_at
from tests.support.thread_ranks import ThreadJob, ThreadRank
from trainer.checkpoint import FORMAT, CheckpointManager, list_checkpoints, step_path
from trainer.train_state import RNGState, ScalerState, TrainState


def test_an_unverifiable_newest_is_skipped_and_all_unusable_stops(tmp_path, capsys):
    for step in (2, 4):
        save_at(tmp_path, step)
    newest = step_path(str(tmp_path), PREFIX, 4)
    with open(newest, "r+b") as f:
        f.truncate(100)
    assert manager(tmp_path).latest()["global_step"] == 2
    assert f"skipping checkpoint {newest}: " in capsys.readouterr().out
    os.remove(f"{step_path(str(tmp_path), PREFIX, 2)}.json")  # killed before its record was written
    with pytest.raises(UserError, match="none of the 2 checkpoints in .* is usable"):
        manager(tmp_path).latest()


def test_a_skipped_newest_whose_record_gave_the_config_stops_a_resume_of_another_run(tmp_path, capsys):
    """The run's config comes from the newest readable record (newest_record) before the checkpoint is
    verified: where that checkpoint is skipped and the one before it was saved with another config
    (a later run's newest, damaged), resuming would train the older state with the later config."""
    def save_with(step, lr):
        state = TrainState(plan(), global_step=step, tokens_seen=100 * step)
        return CheckpointManager(str(tmp_path), PREFIX, CONFIG, FakeModel(), {"train_state": state, "rng": RNGState()},
                                 config={"optim": {"learning_rate": lr}, "output": {"save_dir": str(step)}}).save(step)

    save_with(2, 1e-3)
    newest = save_with(4, 1e-3)  # another launch group: the same run
    with open(newest, "r+b") as f:
        f.truncate(100)
    assert manager(tmp_path).latest()["global_step"] == 2
    for path in (newest, f"{newest}.json"):
        os.remove(path)
    assert save_with(4, 0.5) == newest
    with open(newest, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=rf"checkpoint {newest} is skipped .* was saved with another: move {newest} "
                                        rf"aside and resume again"):
        manager(tmp_path).latest()


def test_a_skipped_newest_never_costs_the_saves_after_the_resume(tmp_path):
    """1 process saves steps 2, 4 and 6; step 6 is found damaged, and the resume on 2 processes
    starts from step 4 (2 processes' step 2), whose next save, step 3, holds fewer tokens than
    step 6. With --keep_last 1 the rotation keeps that save: the damaged step 6, which sorts
    ahead of it, is neither counted nor removed."""
    for step in (2, 4, 6):
        save_at(tmp_path, step, tokens=100 * step, run_number=1)
    damaged = step_path(str(tmp_path), PREFIX, 6)
    with open(damaged, "r+b") as f:
        f.truncate(100)
    assert manager(tmp_path).latest()["global_step"] == 4
    path = save_at(tmp_path, 3, tokens=500, keep_last=1, run_number=1)
    assert [Path(p).name for p in list_checkpoints(str(tmp_path), PREFIX)] == \
        [Path(damaged).name, Path(path).name]
    assert manager(tmp_path).latest()["tokens_seen"] == 500  # the damaged one skipped again, the new one used


@pytest.mark.parametrize("record", [{"files": []}, {"files": {"x.pth": 3}}, {"files": {"x.pth": {"size": 1}}}])
def test_a_record_of_the_wrong_shape_is_skipped_like_a_damaged_one(tmp_path, capsys, record):
    for step in (2, 4):
        save_at(tmp_path, step)
    newest = step_path(str(tmp_path), PREFIX, 4)
    Path(f"{newest}.json").write_text(json.dumps({**json.loads(Path(f"{newest}.json").read_text()), **record}))
    assert manager(tmp_path).latest()["global_step"] == 2
    assert f"skipping checkpoint {newest}: unreadable record" in capsys.readouterr().out


@pytest.mark.parametrize("left_out", ["scaler", "rng"])
def test_a_newest_checkpoint_without_one_of_the_parts_gives_way_to_the_one_before(tmp_path, capsys, left_out):
    """A checkpoint that lacks the entry of one of this run's parts (written by a version
    without that part) is skipped like a damaged one, in one line, and the one before resumes."""
    rank = ThreadRank(ThreadJob(1), 0)

    def parts(state, *left):
        every = {"train_state": state, "scaler": ScalerState(torch.amp.GradScaler("cpu", enabled=False)),
                 "rng": RNGState(rank)}
        return {name: part for name, part in every.items() if name not in left}

    manager(tmp_path, rank, parts=parts(TrainState(plan(), 2, 200))).save(2)
    manager(tmp_path, rank, parts=parts(TrainState(plan(), 4, 400), left_out)).save(4)
    capsys.readouterr()
    state = TrainState(plan())
    saved = manager(tmp_path, rank, parts=parts(state)).resume()
    assert saved["path"] == step_path(str(tmp_path), PREFIX, 2) and state.global_step == 2
    newest = step_path(str(tmp_path), PREFIX, 4)
    assert capsys.readouterr().out.splitlines() == \
        [f"skipping checkpoint {newest}: not a {FORMAT} checkpoint (missing ['{left_out}'])"]


def test_no_checkpoint_starts_fresh_but_another_shape_is_named(tmp_path):
    assert manager(tmp_path / "empty").resume() is None
    save_at(tmp_path, 2)
    wider = dict(CONFIG, hidden_size=128)
    other = CheckpointManager(str(tmp_path), "pretrain_128", wider, FakeModel(), {},
                              collectives=ThreadRank(ThreadJob(1), 0))
    with pytest.raises(UserError, match="saved with hidden_size=64, but the flags give hidden_size=128"):
        other.latest()
    # Another --save_weight is another run, whatever its shape: a first --from_resume 1 starts fresh.
    another_run = CheckpointManager(str(tmp_path), "small_128", wider, FakeModel(), {},
                                    collectives=ThreadRank(ThreadJob(1), 0))
    assert another_run.latest() is None
