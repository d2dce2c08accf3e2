"""Fault injection for the fault-tolerance tests: step hooks (trainer/hooks.py) that make one
rank misbehave at one step, planned by the environment the test gives its run:

    MINIMIND_FAULT_AT_STEP=k    global step at which to misbehave (counted from 0)
    MINIMIND_FAULT_RANK=r       which rank misbehaves (default 0)
    MINIMIND_FAULT_KIND=kind    kill  - SIGKILL itself before step k (default)
                                raise - raise RuntimeError before step k
                                nan   - make its loss NaN at step k
                                nan_forever - make its loss NaN from step k on

fault_env() gives that environment, with MINIMIND_STEP_HOOKS naming this module's factory,
so launched, forked and in-process runs all pick the hooks up. A fault fires only in the
first attempt of a torchrun group (TORCHELASTIC_RESTART_COUNT 0 or unset), so a restarted
group runs clean.
"""
import math
import os
import signal
from dataclasses import dataclass

from trainer.hooks import HOOKS_VARIABLE, StepHooks


def fault_env(kind: str, at: int, rank: int = 0) -> dict:
    """The environment that makes rank `rank` misbehave (`kind`) at step `at`."""
    return {HOOKS_VARIABLE: f"{__name__}:fault_plan", "MINIMIND_FAULT_AT_STEP": str(at),
            "MINIMIND_FAULT_RANK": str(rank), "MINIMIND_FAULT_KIND": kind}


@dataclass
class FaultPlan(StepHooks):
    """This rank's injected fault, read from the environment once, at start-up."""
    rank: int = 0
    kind: str | None = None  # None: no fault for this rank in this attempt
    at_step: int = 0
    poisoned: bool = False  # this step's loss is to be NaN

    @classmethod
    def from_env(cls, rank: int, environ=os.environ) -> "FaultPlan":
        at = environ.get("MINIMIND_FAULT_AT_STEP")
        if at is None or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return cls(rank)
        if rank != int(environ.get("MINIMIND_FAULT_RANK", "0")):
            return cls(rank)
        return cls(rank, environ.get("MINIMIND_FAULT_KIND", "kill"), int(at))

    def fires(self, global_step: int, kinds) -> bool:
        if self.kind not in kinds:
            return False
        return global_step >= self.at_step if self.kind == "nan_forever" else global_step == self.at_step

    def before_step(self, global_step: int):
        if self.fires(global_step, ("kill",)):
            print(f"[fault injection] rank {self.rank} SIGKILLs itself at step {global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires(global_step, ("raise",)):
            raise RuntimeError(f"[fault injection] rank {self.rank} raises at step {global_step}")
        self.poisoned = self.fires(global_step, ("nan", "nan_forever"))

    def loss(self, loss):
        return loss * math.nan if self.poisoned else loss


def fault_plan(rank: int) -> FaultPlan:
    """The factory MINIMIND_STEP_HOOKS names: this rank's plan, from the environment."""
    return FaultPlan.from_env(rank)
