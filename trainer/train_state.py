"""Where a run is: its step plan, the position of a step in the data, and the train
state that a checkpoint saves and a resume loads (in torchtitan's Stateful style).

Why every run -- one process or many -- goes through a DistributedSampler: rank r
of W reads positions r, r+W, r+2W, ... of one shared per-epoch permutation, and a
micro-batch takes b consecutive positions of a rank's share. An optimizer step of
A micro-batches therefore covers exactly the global positions [k*G, (k+1)*G) with
G = b*W*A, whatever W is. That makes resuming on another world size a matter of
skipping k*G positions, and with a fixed G the sample order is topology-invariant.
"""
from dataclasses import dataclass
from typing import ClassVar

from common.errors import UserError
from trainer.distributed import Logger


@dataclass(frozen=True)
class StepPlan:
    batch_size: int  # the micro-batch of one rank
    world_size: int
    accumulation_steps: int
    steps_per_epoch: int  # whole global batches only: the ragged tail of an epoch is dropped
    total_steps: int

    @property
    def samples_per_step(self) -> int:
        """The global batch: micro-batch x world size x accumulation."""
        return self.batch_size * self.world_size * self.accumulation_steps

    @property
    def epochs(self) -> int:
        return -(-self.total_steps // self.steps_per_epoch)

    def position(self, step: int) -> "DataPosition":
        """Where in the data optimizer step `step` (counted from 0) starts."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        return DataPosition(epoch, step_in_epoch, step_in_epoch * self.batch_size * self.accumulation_steps)


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    step_in_epoch: int
    sampler_start: int  # positions of each rank's share of the epoch already consumed


def plan_steps(args, num_samples: int, world_size: int) -> StepPlan:
    """How many samples an optimizer step takes, and how many steps the run makes.
    --global_batch_size, when given, decides the accumulation steps."""
    accum = args.accumulation_steps
    if args.global_batch_size:
        per_micro_step = args.batch_size * world_size
        if args.global_batch_size % per_micro_step:
            raise UserError(f"--global_batch_size {args.global_batch_size} is not a multiple of --batch_size "
                            f"{args.batch_size} x {world_size} processes = {per_micro_step}")
        accum = args.global_batch_size // per_micro_step
    samples_per_step = args.batch_size * world_size * accum
    steps_per_epoch = num_samples // samples_per_step
    if steps_per_epoch == 0:
        raise UserError(f"--data_path {args.data_path}: {num_samples} training samples, fewer than one global "
                        f"batch of {samples_per_step} (--batch_size {args.batch_size} x {world_size} processes x "
                        f"{accum} accumulation steps); lower --batch_size or add data")
    return StepPlan(args.batch_size, world_size, accum, steps_per_epoch,
                    args.max_steps or args.epochs * steps_per_epoch)


def resume_step(saved_step_in_epoch: int, saved_samples_per_step: int, samples_per_step: int) -> int:
    """The step within the saved epoch to resume at, in this run's step size.

    The saved run consumed saved_step_in_epoch * saved_samples_per_step positions of
    the epoch's permutation; with a different world size (or batch, or accumulation)
    that is re-expressed in steps of samples_per_step, rounded down: a partly covered
    step is redone (up to samples_per_step - 1 samples seen twice), never skipped.
    """
    return saved_step_in_epoch * saved_samples_per_step // samples_per_step


@dataclass
class TrainState:
    """The run's progress. state_dict() holds what a checkpoint records about it; the
    data position is stored as (epoch, step in epoch, samples per step), so that
    load_state_dict() can re-express it in this run's step size."""
    # What load_state_dict() cannot do without (a run may have no wandb_run_id); and what is
    # also written beside each checkpoint, so that choosing the newest unpickles none of them.
    keys: ClassVar = ("global_step", "epoch", "step_in_epoch", "samples_per_step", "world_size", "tokens_seen")
    record_keys: ClassVar = ("global_step", "tokens_seen", "world_size")

    plan: StepPlan
    global_step: int = 0
    tokens_seen: int = 0
    wandb_run_id: str | None = None

    def state_dict(self) -> dict:
        where = self.plan.position(self.global_step)
        return {"global_step": self.global_step, "epoch": where.epoch, "step_in_epoch": where.step_in_epoch,
                "samples_per_step": self.plan.samples_per_step, "world_size": self.plan.world_size,
                "tokens_seen": self.tokens_seen, "wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, saved: dict):
        self.global_step = self.resumed_step(saved)
        self.tokens_seen = saved["tokens_seen"]
        self.wandb_run_id = saved.get("wandb_run_id")
        if saved["samples_per_step"] != self.plan.samples_per_step:
            step_in_epoch = self.global_step - saved["epoch"] * self.plan.steps_per_epoch
            Logger(f"resume: world size {saved['world_size']} -> {self.plan.world_size}, step "
                   f"{saved['step_in_epoch']} -> {step_in_epoch} of epoch {saved['epoch']} (step * "
                   f"{saved['samples_per_step']} samples // {self.plan.samples_per_step} samples per step)")

    def resumed_step(self, saved: dict) -> int:
        """The saved data position as a step of this run (its plan may differ in world size)."""
        step_in_epoch = resume_step(saved["step_in_epoch"], saved["samples_per_step"], self.plan.samples_per_step)
        return saved["epoch"] * self.plan.steps_per_epoch + step_in_epoch
