"""What a run is and holds: its step plan, where each step is in the data, and the parts a
checkpoint saves and a resume loads, each the owner of its entries (torchtitan's Stateful
style): state_dict() returns the top-level entries the part adds to a checkpoint,
load_state_dict(saved) reads them back from a whole checkpoint, `keys` names the entries it
cannot load without, so that trainer/checkpoint.py skips a checkpoint lacking one, and
`record_keys`, where a part has any, the ones written in the checkpoint's JSON record as well
(read without unpickling).
How and where a checkpoint is written, and which one a resume takes, is trainer/checkpoint.py's.

    TrainState   "global_step", "tokens_seen", "world_size", the data position, "wandb_run_id"
    ModelState   "model", "optimizer" (in the .pth, or as a .dcp folder's shards), and the
                 inference weights beside them (model/weights.py's format)
    ScalerState  "scaler" (fp16's GradScaler)
    RNGState     "rng": every rank's generators, restored only at the world size they were saved at

Why every run -- one process or many -- goes through a DistributedSampler: rank r
of W reads positions r, r+W, r+2W, ... of one shared per-epoch permutation, and a
micro-batch takes b consecutive positions of a rank's share. An optimizer step of
A micro-batches therefore covers exactly the global positions [k*G, (k+1)*G) with
G = b*W*A, whatever W is. That makes resuming on another world size a matter of
skipping k*G positions, and with a fixed G the sample order is topology-invariant.
"""
import random
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict,
)

from common.errors import UserError
from model.weights import write_weights
from trainer.distributed import TORCH_COLLECTIVES, Logger, full_state_dict, weights_finite


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


def accumulation_steps(optim, world_size: int) -> int:
    """Micro-batches per optimizer step: --accumulation_steps, or what --global_batch_size implies."""
    if not optim.global_batch_size:
        return optim.accumulation_steps
    per_micro_step = optim.batch_size * world_size
    if optim.global_batch_size % per_micro_step:
        raise UserError(f"--global_batch_size {optim.global_batch_size} is not a multiple of --batch_size "
                        f"{optim.batch_size} x {world_size} processes = {per_micro_step}")
    return optim.global_batch_size // per_micro_step


def global_batch(optim, world_size: int) -> int:
    """Samples per optimizer step over all ranks: micro-batch x world size x accumulation."""
    return optim.batch_size * world_size * accumulation_steps(optim, world_size)


def plan_steps(optim, data_path: str, num_samples: int, world_size: int) -> StepPlan:
    """How many samples an optimizer step takes, and how many steps the run makes, from the
    config's optim group. --global_batch_size, when given, decides the accumulation steps."""
    batch, accum = optim.batch_size, accumulation_steps(optim, world_size)
    samples_per_step = batch * world_size * accum
    steps_per_epoch = num_samples // samples_per_step
    if steps_per_epoch == 0:
        raise UserError(f"--data_path {data_path}: {num_samples} training samples, fewer than one global "
                        f"batch of {samples_per_step} (--batch_size {batch} x {world_size} processes x "
                        f"{accum} accumulation steps); lower --batch_size or add data")
    return StepPlan(batch, world_size, accum, steps_per_epoch, optim.max_steps or optim.epochs * steps_per_epoch)


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
    # also written in each checkpoint's record, so that choosing the newest unpickles none of them.
    keys: ClassVar = ("global_step", "epoch", "step_in_epoch", "samples_per_step", "world_size", "tokens_seen")
    record_keys: ClassVar = ("global_step", "tokens_seen", "world_size", "run_number", "samples_per_step")

    plan: StepPlan
    global_step: int = 0
    tokens_seen: int = 0
    wandb_run_id: str | None = None
    unread_tokens: torch.Tensor | None = None  # each step's tokens, summed on the device since the last read
    # Which run of this --checkpoint_dir and prefix: a fresh run's is one more than the newest
    # there (CheckpointManager.next_run_number), a resume keeps the checkpoint's.
    run_number: int = 0

    def read_tokens(self) -> int:
        """tokens_seen, with the steps' tokens on the device read in (one host read)."""
        if self.unread_tokens is not None:
            self.tokens_seen += int(self.unread_tokens.item())
            self.unread_tokens.zero_()
        return self.tokens_seen

    def state_dict(self) -> dict:
        self.read_tokens()
        where = self.plan.position(self.global_step)
        return {"global_step": self.global_step, "epoch": where.epoch, "step_in_epoch": where.step_in_epoch,
                "samples_per_step": self.plan.samples_per_step, "world_size": self.plan.world_size,
                "tokens_seen": self.tokens_seen, "wandb_run_id": self.wandb_run_id, "run_number": self.run_number}

    def load_state_dict(self, saved: dict):
        self.global_step = self.resumed_step(saved)
        self.tokens_seen = saved["tokens_seen"]
        self.wandb_run_id = saved.get("wandb_run_id")
        self.run_number = saved.get("run_number", 0)  # 0: saved before runs were numbered
        if saved["samples_per_step"] != self.plan.samples_per_step:
            step_in_epoch = self.global_step - saved["epoch"] * self.plan.steps_per_epoch
            # The world size, the batch or the accumulation changed: name the step size, not one cause.
            Logger(f"resume: {saved['samples_per_step']} -> {self.plan.samples_per_step} samples per step (world size "
                   f"{saved['world_size']} -> {self.plan.world_size}), step {saved['step_in_epoch']} -> "
                   f"{step_in_epoch} of epoch {saved['epoch']} (step * {saved['samples_per_step']} // "
                   f"{self.plan.samples_per_step})")

    def resumed_step(self, saved: dict) -> int:
        """The saved data position as a step of this run (its plan may differ in world size)."""
        step_in_epoch = resume_step(saved["step_in_epoch"], saved["samples_per_step"], self.plan.samples_per_step)
        return saved["epoch"] * self.plan.steps_per_epoch + step_in_epoch


# ---------------------------------------------------------------------------- the model, optimizer, scaler, RNGs
class ModelState:
    """The model's weights and the optimizer's state, by parameter name (DCP's state-dict API),
    so that they load into any layout: one process, DDP, or FSDP at any world size."""
    keys = ("model", "optimizer")  # in a .pth; a .dcp folder holds them as shards instead

    def __init__(self, model, optimizer, collectives=TORCH_COLLECTIVES):
        self.model, self.optimizer, self.collectives = model, optimizer, collectives

    def state_dict(self) -> dict:
        """Full tensors in one process and under DDP; every rank's shards (DTensors) under FSDP.
        Every rank must call it: under FSDP it is a collective."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, saved: dict):
        """From a .pth (in rank 0's memory only: rank 0 broadcasts it tensor by tensor and every
        rank keeps its part, so no other rank reads the file, which may not even exist on its
        node), or from the .dcp folder at saved["path"] in whatever sharding it was saved.
        The optimizer's moments and buffers load, but its param groups keep the hyperparameters
        this run's config built them with (the stored values, or a flag typed on resume)."""
        built = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self._load(saved)
        for group, hyperparameters in zip(self.optimizer.param_groups, built):
            group.update(hyperparameters)

    def _load(self, saved: dict):
        if not saved["path"].endswith(".dcp"):
            # Two calls, not set_state_dict: with an empty model state (every rank but 0) it
            # would skip the model on those ranks and leave rank 0 alone in the broadcast.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.collectives.world_size > 1)
            set_optimizer_state_dict(self.model, self.optimizer, saved.get("optimizer", {}), options=options)
            set_model_state_dict(self.model, saved.get("model", {}), options=options)
            return
        # Describe what this run holds, and let DCP fill it from whatever sharding was saved.
        state = self.state_dict()
        dcp.load(state, checkpoint_id=saved["path"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def finite(self) -> bool:
        """No rank holds a NaN or Inf weight (a collective)."""
        return weights_finite(self.model)

    def full_weights(self) -> dict:
        """The whole model's weights as CPU tensors (a collective: a gather under FSDP)."""
        return full_state_dict(self.model)

    def write_weights(self, weights: dict, path: str):
        """Rank 0: full_weights() as the inference weights at `path`, with the model's config beside them."""
        write_weights(weights, self.model.config, path, elsewhere="pass another --save_dir",
                      then=", then relaunch with --from_resume 1")

    def estimated_bytes(self) -> int:
        """About what a checkpoint of this model and optimizer takes: fp32 weights, and the
        optimizer's state (AdamW two tensors a weight, Muon one), before a step has made it."""
        total = 0
        for group in self.optimizer.param_groups:
            states = 1 if group.get("name") == "muon" else 2
            total += sum(p.numel() * p.element_size() * (1 + states) for p in group["params"])
        return total


class ScalerState:
    keys = ("scaler",)

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, saved: dict):
        """A run without loss scaling (bf16, fp32) saves an empty scaler state: an fp16 resume of it
        starts its scale afresh, which the first overflowing steps calibrate, as at any fp16 start."""
        if saved["scaler"] or not self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])


class RNGState:
    """Every rank's random generators (Python, numpy, torch, CUDA). Restored only at the world
    size they were saved at: on another one, rank r's generators would be another rank's."""
    keys = ("rng",)

    def __init__(self, collectives=TORCH_COLLECTIVES):
        self.collectives = collectives

    def state_dict(self) -> dict:
        """Every rank's state, gathered (a collective): rank 0 is the one that writes them."""
        gathered = self.collectives.all_gather(capture_rng_state())
        return {"rng": gathered}

    def load_state_dict(self, saved: dict):
        if len(saved["rng"]) == self.collectives.world_size:
            restore_rng_state(saved["rng"][self.collectives.rank])


def capture_rng_state() -> dict:
    # numpy's state is stored as a tensor so the checkpoint loads with weights_only=True.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict):
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(obj):
    # random.setstate insists on tuples; a round trip through some loaders yields lists.
    return tuple(_as_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj

