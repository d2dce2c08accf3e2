"""A CheckpointManager over stand-in parts, in this process, for the tests of tests/resume/: a model
part without a model, a small plan, and saves at a given step."""
import torch

from model.model_minimind import MiniMindConfig
from tests.support.thread_ranks import ThreadJob, ThreadRank
from tests.support.tiny import FLAGS
from trainer.checkpoint import CheckpointManager
from trainer.train_state import ModelState, RNGState, StepPlan, TrainState

PREFIX = "pretrain_64"
CONFIG = MiniMindConfig(**FLAGS).to_dict()


class FakeModel:
    """The model part without a model: fixed weights, and what a resume gave it."""
    keys = ModelState.keys

    def __init__(self, value: float = 1.0):
        self.weights, self.loaded = {"w": torch.full((4, 4), value)}, None

    def finite(self):
        return True

    def state_dict(self):
        return {"model": self.weights, "optimizer": {"state": {}, "param_groups": []}}

    def load_state_dict(self, saved):
        self.loaded = saved


def plan(world_size=1):
    return StepPlan(batch_size=4, world_size=world_size, accumulation_steps=2 // world_size, steps_per_epoch=100,
                    total_steps=100)


def manager(folder, rank=None, model=None, state=None, keep_last=3, config=CONFIG, parts=None) -> CheckpointManager:
    collectives = rank if rank is not None else ThreadRank(ThreadJob(1), 0)
    state = state or TrainState(plan(collectives.world_size))
    parts = parts or {"train_state": state, "rng": RNGState(collectives)}
    return CheckpointManager(str(folder), PREFIX, config, model or FakeModel(), parts, keep_last,
                             collectives=collectives)


def save_at(folder, step, tokens=None, keep_last=3, run_number=0):
    state = TrainState(plan(), global_step=step, tokens_seen=tokens if tokens is not None else 100 * step,
                       run_number=run_number)
    return manager(folder, state=state, keep_last=keep_last).save(step)
