"""What the flags leave to the machine, decided once at start-up: --dtype auto and
--optimizer auto become names, and the run uses these instead of the flags."""
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from trainer.optim import detect_dtype, detect_optimizer
from trainer.distributed import Logger


@dataclass(frozen=True)
class RunSettings:
    dtype: str  # float32 | bfloat16 | float16
    optimizer: str  # adamw | muon
    device: str
    sharded: bool  # FSDP over several processes: sharded weights, optimizer state and checkpoints

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def autocast(self) -> AbstractContextManager:
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.torch_dtype)

    def as_flags(self, args, accumulation_steps: int) -> dict:
        """The flags with what the run resolved in place of auto and of the derived values
        (what wandb records): the dtype, the optimizer and, under --global_batch_size, the
        accumulation steps it implies."""
        return {**vars(args), "dtype": self.dtype, "optimizer": self.optimizer,
                "accumulation_steps": accumulation_steps}


def resolve_settings(args, env) -> RunSettings:
    sharded = args.parallel == "fsdp" and env.distributed
    dtype, why = detect_dtype(args.dtype, env.device, sharded=sharded)
    Logger(f"dtype: {dtype} ({why})")
    optimizer, why = detect_optimizer(args.optimizer, env.device, args.param_groups)
    Logger(f"optimizer: {optimizer} ({why})")
    return RunSettings(dtype, optimizer, env.device, sharded)
