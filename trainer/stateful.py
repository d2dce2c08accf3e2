"""The parts of a run that a checkpoint holds, each saving and loading itself (torchtitan's
Stateful style): state_dict() returns the top-level entries the part adds to a checkpoint,
load_state_dict(saved) reads them back from a whole checkpoint, and `keys` names the entries
it cannot load without, so that the CheckpointManager (trainer/checkpoint.py) skips a
checkpoint lacking one as unusable instead of choosing it. The run's progress and data
position is TrainState (trainer/train_state.py).

    ModelState   "model", "optimizer" (in the .pth, or as a .dcp folder's shards)
    ScalerState  "scaler" (fp16's GradScaler)
    RNGState     "rng": every rank's generators, restored only at the world size they were saved at
"""
import os
import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict,
)

from common.atomic import atomic_torch_save, atomic_write_text
from model.weights import sidecar_path, sidecar_text
from trainer.distributed import TORCH_COLLECTIVES, is_main_process
from trainer.parallel import full_state_dict, weights_finite


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
        node), or from the .dcp folder at saved["path"] in whatever sharding it was saved."""
        if not saved["path"].endswith(".dcp"):
            # Two calls, not set_state_dict: with an empty model state (every rank but 0) it
            # would skip the model on those ranks and leave rank 0 alone in the broadcast.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.collectives.world_size > 1)
            set_optimizer_state_dict(self.model, self.optimizer, saved.get("optimizer", {}), options=options)
            set_model_state_dict(self.model, saved.get("model", {}), options=options)
            return
        import torch.distributed.checkpoint as dcp

        # Describe what this run holds, and let DCP fill it from whatever sharding was saved.
        state = self.state_dict()
        dcp.load(state, checkpoint_id=saved["path"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


    def finite(self) -> bool:
        """No rank holds a NaN or Inf weight (a collective)."""
        return weights_finite(self.model)

    def export(self, weights_path: str):
        export_weights(self.model, weights_path)


def export_weights(model, weights_path: str):
    """MiniMind's inference format: a half-precision state_dict at `weights_path` (x.pth), written
    atomically by rank 0, with the model config beside it (x.json) so that the scripts need no
    shape flags. Every rank takes part in gathering the weights when the model is sharded."""
    weights = full_state_dict(model)
    if is_main_process():
        os.makedirs(os.path.dirname(os.path.abspath(weights_path)), exist_ok=True)
        atomic_torch_save({k: v.half() for k, v in weights.items()}, weights_path)
        atomic_write_text(sidecar_path(weights_path), sidecar_text(model.config))


class ScalerState:
    keys = ("scaler",)

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, saved: dict):
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
