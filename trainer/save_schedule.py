"""When to save: every --save_interval steps, and every --save_every_minutes of wall time.

A save is a collective, so every rank must decide to save at the same step. Step
counts agree by construction; clocks do not (nodes drift, and a rank that started
late has seen less time go by). So the time-based decision is rank 0's alone: it
reads its clock and broadcasts the answer. That broadcast is a collective and a
host read, which is why it is asked only every `check_every` steps (the trainer
passes --log_interval, where the loop reads the loss anyway).
"""
import time

import torch
import torch.distributed as dist


class SaveSchedule:
    def __init__(self, every_steps: int, every_minutes: float = 0.0, check_every: int = 1,
                 device="cpu", clock=time.monotonic):
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60
        self.check_every = max(1, check_every)
        self.device = device
        self.clock = clock
        self.last_save = clock()

    def due(self, global_step: int) -> bool:
        """Save after `global_step`? The same answer on every rank; every rank calls it at every step."""
        if global_step % self.every_steps == 0:
            return True
        if not self.every_seconds or global_step % self.check_every:
            return False
        late = torch.tensor(float(self.clock() - self.last_save >= self.every_seconds), device=self.device)
        if dist.is_initialized():
            dist.broadcast(late, src=0)  # rank 0's clock decides for everyone
        return bool(late.item())

    def saved(self):
        """A checkpoint was just written (for whatever reason): the time interval starts again."""
        self.last_save = self.clock()
