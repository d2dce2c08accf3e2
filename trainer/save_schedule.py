"""When to save: every --save_interval steps, and every --save_every_minutes of wall time.

A save is a collective, so every rank must decide to save at the same step. Step counts
agree by construction; clocks do not (nodes drift, and a rank that started late has seen
less time go by). So the time-based decision is rank 0's alone: it reads its own clock
before each step and asks for a save through the step's one all-reduce (trainer/step.py's
Requests.save), which every rank reads at the same step. No collective of its own.
"""
import time


class SaveSchedule:
    def __init__(self, every_steps: int, every_minutes: float = 0.0, is_main: bool = True, clock=time.monotonic):
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60
        self.is_main = is_main
        self.clock = clock
        self.last_save = clock()

    def clock_asks(self) -> bool:
        """This rank's request for a time-based save: rank 0's clock speaks, the others never ask."""
        return self.is_main and bool(self.every_seconds) and self.clock() - self.last_save >= self.every_seconds

    def due(self, global_step: int, asked: bool) -> bool:
        """Save after `global_step`? `asked`: whether the step's agreement says rank 0 asked."""
        return global_step % self.every_steps == 0 or asked

    def saved(self):
        """A checkpoint was just written (for whatever reason): the time interval starts again."""
        self.last_save = self.clock()
