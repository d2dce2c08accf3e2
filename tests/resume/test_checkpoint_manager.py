"""trainer/checkpoint.py's CheckpointManager in this process: save, verify and rotate, over
Stateful parts (which one a resume chooses: test_resume_choice.py). For two ranks, each rank is a thread with a stand-in for the
collectives (tests/support/thread_ranks.py), so the tests see what every rank does: the same
collectives in the same order (or the job would hang), only rank 0 touches
--checkpoint_dir (rank 1's may be another node's disk, even absent), and rank 0's
decision reaches every rank."""
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from common.storage import atomic_torch_save
from common.errors import UserError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support.assertions import tree_digest
from tests.support.run_outputs import latest_link_name
from tests.support.thread_ranks import ThreadJob, ThreadRank
from tests.support.checkpoints import CONFIG, PREFIX, FakeModel, manager, plan, save_at
from tests.support.tiny import FLAGS
from trainer import checkpoint
from trainer.checkpoint import FORMAT, CheckpointManager, list_checkpoints, step_path
from trainer.train_state import ModelState, RNGState, ScalerState, TrainState

# ---------------------------------------------------------------------------- one rank
def test_a_save_is_the_checkpoint_its_record_and_the_link(tmp_path):
    path = save_at(tmp_path, 4)
    assert path == step_path(str(tmp_path), PREFIX, 4)
    assert sorted(tree_digest(tmp_path)) == [latest_link_name(PREFIX), f"{PREFIX}_resume_step0000004.pth",
                                              f"{PREFIX}_resume_step0000004.pth.json"]
    record = json.loads(Path(f"{path}.json").read_text())
    assert (record["global_step"], record["tokens_seen"], record["world_size"]) == (4, 400, 1)
    saved = torch.load(path, weights_only=True)
    assert saved["format"] == FORMAT and saved["model_config"] == CONFIG
    assert {"model", "optimizer", "rng", "global_step", "epoch", "step_in_epoch", "samples_per_step",
            "tokens_seen", "world_size", "wandb_run_id"} <= set(saved)


def test_rotation_keeps_the_newest_by_tokens_trained_not_by_step(tmp_path):
    for step, tokens in [(2, 200), (4, 400), (6, 600), (3, 700)]:  # step 3 of a run on fewer ranks: most tokens
        save_at(tmp_path, step, tokens, keep_last=3)
    assert [Path(p).name for p in list_checkpoints(str(tmp_path), PREFIX)] == \
        [f"{PREFIX}_resume_step{s:07d}.pth" for s in (3, 6, 4)]
    assert os.readlink(tmp_path / latest_link_name(PREFIX)) == f"{PREFIX}_resume_step0000003.pth"
    state = TrainState(plan())
    assert manager(tmp_path, state=state).resume()["global_step"] == 3
    assert state.tokens_seen == 700


def test_a_save_at_a_step_number_already_taken_goes_beside_it_and_never_costs_the_old_one(tmp_path):
    """1 process's step 2 resumes as 2 processes' step 1, whose save at step 2 holds more tokens.
    With keep_last 1 the old checkpoint is the only one: a disk that refuses the new save must
    leave it whole; once the new one fits it takes the next free name, is the newest, and the
    rotation removes the old one."""
    from common.errors import StorageError
    from tests.support.fault_injection import SmallDisk

    disk = SmallDisk(tmp_path / "disk", 1 << 20)
    try:
        with disk.installed():
            save_at(disk.path, 2, tokens=200, keep_last=1)
            disk.fill(leave=1000)
            with pytest.raises(StorageError, match="no space left on device"):
                save_at(disk.path, 2, tokens=400, keep_last=1)
            assert manager(disk.path).latest()["tokens_seen"] == 200  # verified against its record
            disk.empty()
            path = save_at(disk.path, 2, tokens=400, keep_last=1)
        assert path == step_path(str(disk.path), PREFIX, 2, copy=2) == f"{disk.path}/{PREFIX}_resume_step0000002_2.pth"
        assert sorted(p.name for p in disk.path.iterdir()) == sorted([
            latest_link_name(PREFIX), f"{PREFIX}_resume_step0000002_2.pth", f"{PREFIX}_resume_step0000002_2.pth.json"])
        assert manager(disk.path).latest()["tokens_seen"] == 400
    finally:
        disk.close()


def test_of_two_saves_of_the_same_progress_the_later_copy_is_the_newest(tmp_path):
    """A resume that redoes a step (its newest checkpoint was damaged) saves it again beside the
    damaged one, and the redone save is the one kept and resumed."""
    save_at(tmp_path, 2)
    damaged = step_path(str(tmp_path), PREFIX, 2)
    with open(damaged, "r+b") as f:
        f.truncate(100)
    save_at(tmp_path, 2, keep_last=1)
    assert [Path(p).name for p in list_checkpoints(str(tmp_path), PREFIX)] == [f"{PREFIX}_resume_step0000002_2.pth"]
    assert manager(tmp_path).latest()["path"] == step_path(str(tmp_path), PREFIX, 2, copy=2)


def test_a_fresh_run_is_numbered_after_the_newest_here_and_its_checkpoints_come_first(tmp_path, capsys):
    assert manager(tmp_path).next_run_number() == 1  # an empty folder
    assert capsys.readouterr().out == ""
    for step in (3, 4, 5):  # an earlier run, further along
        save_at(tmp_path, step, run_number=1)
    number = manager(tmp_path).next_run_number()
    assert number == 2
    assert "holds 3 checkpoints of an earlier run of pretrain_64 (the newest at step 5)" in capsys.readouterr().out
    save_at(tmp_path, 1, run_number=number)
    assert [Path(p).name for p in list_checkpoints(str(tmp_path), PREFIX)] == \
        [f"{PREFIX}_resume_step{s:07d}.pth" for s in (1, 5, 4)]
    state = TrainState(plan())
    assert manager(tmp_path, state=state).resume()["global_step"] == 1
    assert (state.global_step, state.run_number) == (1, 2)


def test_non_finite_weights_are_never_saved(tmp_path):
    class NaNModel(FakeModel):
        def finite(self):
            return False

    with pytest.raises(UserError, match=r"weights at step 2 are not finite .* the earlier ones are kept: resume"):
        manager(tmp_path, model=NaNModel()).save(2)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_part_saves_and_loads_a_field_of_its_own(tmp_path):
    """Adding a field is one edit, in the part that owns it: the manager carries any part."""
    class Curriculum:
        keys = ("curriculum_stage",)

        def __init__(self, stage=0):
            self.stage = stage

        def state_dict(self):
            return {"curriculum_stage": self.stage}

        def load_state_dict(self, saved):
            self.stage = saved["curriculum_stage"]

    job = ThreadRank(ThreadJob(1), 0)
    make = lambda part: CheckpointManager(str(tmp_path), PREFIX, CONFIG, FakeModel(),  # noqa: E731
                                          {"train_state": TrainState(plan(), 5, 500), "curriculum": part},
                                          collectives=job)
    make(Curriculum(stage=3)).save(5)
    resumed = Curriculum()
    make(resumed).resume()
    assert resumed.stage == 3


def test_a_checkpoint_of_the_first_format_resumes(tmp_path):
    """Checkpoints already written (minimind-resume-v1, one flat dict, as the trainer wrote them
    before the manager) load into today's parts."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**FLAGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 6400, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model_state, optim_state = get_state_dict(model, optimizer)  # by parameter name, as the trainer saved them
    old = {"format": "minimind-resume-v1", "scaler": scaler.state_dict(), "global_step": 8, "epoch": 0,
           "step_in_epoch": 8, "samples_per_step": 8, "world_size": 1, "tokens_seen": 4096, "wandb_run_id": "abc",
           "model_config": CONFIG, "rng": [checkpoint_rng()], "model": model_state,
           "optimizer": optim_state}
    path = step_path(str(tmp_path), PREFIX, 8)
    written = atomic_torch_save(old, path)
    Path(f"{path}.json").write_text(json.dumps({"global_step": 8, "tokens_seen": 4096, "world_size": 1,
                                                 "files": {Path(path).name: written}}))
    torch.manual_seed(1)
    fresh = MiniMindForCausalLM(MiniMindConfig(**FLAGS))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = TrainState(plan())
    saved = CheckpointManager(str(tmp_path), PREFIX, CONFIG, ModelState(fresh, fresh_optimizer),
                              {"train_state": state, "scaler": ScalerState(scaler), "rng": RNGState()}).resume()
    assert saved["path"] == path
    assert (state.global_step, state.tokens_seen, state.wandb_run_id) == (8, 4096, "abc")
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])


def test_an_fp16_resume_of_a_run_without_loss_scaling_starts_its_scale_afresh():
    """bf16 and fp32 runs save a disabled GradScaler's empty state; a resume with --dtype float16
    (or auto on a GPU without bf16) takes it as a fresh scale, and a scaled run's state still loads."""
    unscaled = {"scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict()}
    fp16 = ScalerState(torch.amp.GradScaler("cpu", init_scale=1024.0))
    fp16.load_state_dict(unscaled)
    assert fp16.scaler.get_scale() == 1024.0
    scaled = {"scaler": torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()}
    fp16.load_state_dict(scaled)
    assert fp16.scaler.get_scale() == 8.0
    ScalerState(torch.amp.GradScaler("cpu", enabled=False)).load_state_dict(scaled)  # fp16 -> bf16: dropped


def checkpoint_rng():
    from trainer.train_state import capture_rng_state

    return capture_rng_state()


# ---------------------------------------------------------------------------- two ranks
def test_only_rank_0_writes_and_both_ranks_join_the_same_collectives(tmp_path):
    """Rank 1's --checkpoint_dir is another node's disk: nothing may appear there."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    done = ThreadJob(2).run(lambda rank: manager(folders[rank.rank], rank).save(4))
    for rank, result in done:
        assert not isinstance(result, BaseException), result
    assert sorted(tree_digest(folders[0])) == [latest_link_name(PREFIX), f"{PREFIX}_resume_step0000004.pth",
                                                f"{PREFIX}_resume_step0000004.pth.json"]
    assert not folders[1].exists()
    (rank0, _), (rank1, _) = done
    # the RNGs gathered, rank 0's name for the checkpoint sent, then the save's outcome agreed: rank 1
    # waits for rank 0's write, and learns how it went
    assert rank0.calls == rank1.calls == ["all_gather", "broadcast", "all_gather"]
    saved = torch.load(folders[0] / f"{PREFIX}_resume_step0000004.pth", weights_only=True)
    assert len(saved["rng"]) == 2  # every rank's generators


def test_rank_1_resumes_from_rank_0s_pick_without_opening_its_folder(tmp_path, monkeypatch):
    node0 = tmp_path / "node0"
    for step in (2, 4, 6):
        ThreadJob(2).run(lambda rank: manager(node0 if rank.rank == 0 else tmp_path / "node1", rank,
                                              state=TrainState(plan(2), step, 100 * step)).save(step))
    looked = []
    real = checkpoint.list_checkpoints
    monkeypatch.setattr(checkpoint, "list_checkpoints",
                        lambda *a: looked.append(threading.current_thread().name) or real(*a))
    models, states = [FakeModel(), FakeModel()], [TrainState(plan(2)), TrainState(plan(2))]
    done = ThreadJob(2).run(lambda rank: manager(node0 if rank.rank == 0 else tmp_path / "absent", rank,
                                                 model=models[rank.rank], state=states[rank.rank]).resume())
    (rank0, on_rank0), (rank1, on_rank1) = done
    assert looked and set(looked) == {"rank0"}
    assert not (tmp_path / "absent").exists()
    assert on_rank0 == on_rank1 and on_rank0["global_step"] == 6 and on_rank0["path"].startswith(str(node0))
    assert [s.global_step for s in states] == [6, 6]
    assert "model" in models[0].loaded and "model" not in models[1].loaded  # the weights reach rank 1 by broadcast
    assert rank0.calls == rank1.calls


def test_rank_0s_refusal_stops_every_rank_with_its_message(tmp_path):
    save_at(tmp_path, 2)
    wider = dict(CONFIG, hidden_size=128)
    done = ThreadJob(2).run(lambda rank: manager(tmp_path if rank.rank == 0 else tmp_path / "elsewhere", rank,
                                                 config=wider).latest())
    messages = [str(result) for _, result in done]
    assert all(isinstance(result, UserError) for _, result in done)
    assert messages[0] == messages[1] and "hidden_size=64, but the flags give hidden_size=128" in messages[0]


def test_a_save_the_disk_refuses_stops_every_rank_alike_and_rotates_nothing_away(tmp_path):
    """keep_last 1: the save at step 4 does not fit, so step 2's checkpoint, the only good one,
    must stay; every rank raises rank 0's one line (rank 1's folder is another node's disk), and
    nothing of step 4 is left."""
    from common.errors import StorageError
    from tests.support.fault_injection import SmallDisk

    disk = SmallDisk(tmp_path / "disk", 1 << 20)
    try:
        with disk.installed():
            folders = [disk.path, tmp_path / "node1"]
            state = lambda step: TrainState(plan(2), step, 100 * step)  # noqa: E731
            first = ThreadJob(2).run(lambda rank: manager(folders[rank.rank], rank, state=state(2),
                                                          keep_last=1).save(2))
            assert not any(isinstance(result, BaseException) for _, result in first)
            disk.fill(leave=1000)
            (rank0, result0), (rank1, result1) = ThreadJob(2).run(
                lambda rank: manager(folders[rank.rank], rank, state=state(4), keep_last=1).save(4))
        assert isinstance(result0, StorageError) and str(result0) == str(result1)
        assert str(result0).startswith(f"cannot write the checkpoint {disk.path}/{PREFIX}_resume_step0000004.pth: "
                                       f"no space left on device")
        assert rank0.calls == rank1.calls
        assert sorted(p.name for p in disk.path.iterdir()) == sorted([
            "ballast", latest_link_name(PREFIX), f"{PREFIX}_resume_step0000002.pth",
            f"{PREFIX}_resume_step0000002.pth.json"])
        assert not folders[1].exists()
    finally:
        disk.close()
