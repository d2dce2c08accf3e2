"""The checkpointer as one rank of a job sees it, in this process: the distributed
plumbing it calls (is_main_process, barrier, broadcast_from_main) is replaced by a
fake that plays rank 0 or rank 1 and records every collective. What the tests show:
every rank takes part in the same collectives in the same order (or the job hangs),
only rank 0 touches --checkpoint_dir, and rank 0's decision reaches every rank."""
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.fault_helpers import tree_digest
from tests.launch_utils import FLAGS
from trainer import checkpoint
from trainer.checkpoint import load_latest_checkpoint, save_checkpoint

PREFIX = "pretrain_64"


class FakeRank:
    """One rank's view of a 2-rank job. Rank 0's broadcasts are kept in `sent`; a rank
    other than 0 receives them from `received`, in order, as broadcast_from_main would."""

    def __init__(self, rank: int, received=()):
        self.rank, self.collectives, self.sent, self.received = rank, [], [], list(received)

    def install(self, monkeypatch):
        monkeypatch.setattr(checkpoint, "is_main_process", lambda: self.rank == 0)
        monkeypatch.setattr(checkpoint, "barrier", lambda: self.collectives.append("barrier"))
        monkeypatch.setattr(checkpoint, "broadcast_from_main", self.broadcast)
        return self

    def broadcast(self, obj):
        self.collectives.append("broadcast")
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        return self.received.pop(0)


def tiny_model_and_optimizer():
    torch.manual_seed(0)
    config = MiniMindConfig(**FLAGS)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return config, model, optimizer


def trainer_state(config, step: int) -> dict:
    return {"scaler": {}, "global_step": step, "epoch": 0, "step_in_epoch": step, "samples_per_step": 8,
            "world_size": 2, "model_config": config.to_dict(), "tokens_seen": 512 * step}


def test_only_rank_0_writes_and_both_ranks_join_the_same_collectives(tmp_path, monkeypatch):
    config, model, optimizer = tiny_model_and_optimizer()
    rank0 = FakeRank(0).install(monkeypatch)
    save_checkpoint(trainer_state(config, 4), model, optimizer, str(tmp_path / "rank0"), PREFIX)
    rank1 = FakeRank(1).install(monkeypatch)
    save_checkpoint(trainer_state(config, 4), model, optimizer, str(tmp_path / "rank1"), PREFIX)

    assert sorted(tree_digest(tmp_path / "rank0")) == [
        f"{PREFIX}_resume.pth", f"{PREFIX}_resume_step0000004.pth", f"{PREFIX}_resume_step0000004.pth.json"]
    assert not (tmp_path / "rank1").exists()
    assert rank0.collectives == rank1.collectives and rank0.collectives, rank0.collectives


def test_rank_1_resumes_from_rank_0s_pick_without_opening_the_folder(tmp_path, monkeypatch):
    """A node-local disk: the checkpoint exists on rank 0's node only."""
    config, model, optimizer = tiny_model_and_optimizer()
    FakeRank(0).install(monkeypatch)
    for step in (2, 4, 6):
        save_checkpoint(trainer_state(config, step), model, optimizer, str(tmp_path), PREFIX, keep_last=2)
    assert [Path(p).name for p in checkpoint.list_checkpoints(str(tmp_path), PREFIX)] == \
        [f"{PREFIX}_resume_step0000006.pth", f"{PREFIX}_resume_step0000004.pth"]

    rank0 = FakeRank(0).install(monkeypatch)
    on_rank0 = load_latest_checkpoint(str(tmp_path), PREFIX, config.to_dict())
    (tmp_path / "node0").mkdir()
    for path in list(tmp_path.glob(f"{PREFIX}*")):  # off rank 1's disk: even the path it is told is gone
        path.rename(tmp_path / "node0" / path.name)
    rank1 = FakeRank(1, received=rank0.sent).install(monkeypatch)
    monkeypatch.setattr(checkpoint, "list_checkpoints", lambda *a: pytest.fail("rank 1 looked at the folder"))
    on_rank1 = load_latest_checkpoint(str(tmp_path), PREFIX, config.to_dict())

    assert on_rank0["global_step"] == on_rank1["global_step"] == 6
    assert on_rank0["path"] == on_rank1["path"]
    assert "model" in on_rank0 and "model" not in on_rank1  # the weights reach rank 1 by broadcast, later
    assert rank0.collectives == rank1.collectives == ["broadcast"]


def test_rank_0s_refusal_stops_every_rank_with_its_message(tmp_path, monkeypatch):
    config, model, optimizer = tiny_model_and_optimizer()
    FakeRank(0).install(monkeypatch)
    save_checkpoint(trainer_state(config, 2), model, optimizer, str(tmp_path), PREFIX)
    wider = dict(config.to_dict(), hidden_size=128)

    rank0 = FakeRank(0).install(monkeypatch)
    with pytest.raises(UserError, match="hidden_size=64, but the flags give hidden_size=128") as on_rank0:
        load_latest_checkpoint(str(tmp_path), PREFIX, wider)
    FakeRank(1, received=rank0.sent).install(monkeypatch)
    with pytest.raises(UserError) as on_rank1:
        load_latest_checkpoint(str(tmp_path / "not_on_this_node"), PREFIX, wider)
    assert str(on_rank1.value) == str(on_rank0.value)
