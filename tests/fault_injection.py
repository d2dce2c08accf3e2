"""Fault injection for the fault-tolerance tests: one rank misbehaves at one step, as the
environment the test gives its run plans it:

    MINIMIND_FAULT_AT_STEP=k    global step at which to misbehave (counted from 0)
    MINIMIND_FAULT_RANK=r       which rank misbehaves (default 0)
    MINIMIND_FAULT_KIND=kind    kill  - SIGKILL itself before step k (default)
                                raise - raise RuntimeError before step k
                                nan   - make its loss NaN at step k
                                nan_forever - make its loss NaN from step k on

The trainer has no hooks for this: install() wraps two of its functions in the process it
runs in, the loop's set_lr (called once before every optimizer step, with the step) and the
model's loss. A run reaches install() whatever its launch: a launched process through
tests/inject/sitecustomize.py (fault_env puts that folder first on PYTHONPATH), a forked
rank (tests/forked_ranks.py) and an in-process run (tests/jobs.py) by calling it. A fault
fires only in the first attempt of a torchrun group (TORCHELASTIC_RESTART_COUNT 0 or
unset), so a restarted group runs clean.
"""
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

INJECT_DIR = Path(__file__).resolve().parent / "inject"
REPO_ROOT = Path(__file__).resolve().parents[1]
VARIABLES = ("MINIMIND_FAULT_AT_STEP", "MINIMIND_FAULT_RANK", "MINIMIND_FAULT_KIND")


def fault_env(kind: str, at: int, rank: int = 0) -> dict:
    """The environment that makes rank `rank` misbehave (`kind`) at step `at`."""
    return {"PYTHONPATH": f"{INJECT_DIR}{os.pathsep}{REPO_ROOT}", "MINIMIND_FAULT_AT_STEP": str(at),
            "MINIMIND_FAULT_RANK": str(rank), "MINIMIND_FAULT_KIND": kind}


@dataclass
class FaultPlan:
    """This rank's injected fault, read from the environment once, at start-up."""
    rank: int = 0
    kind: str | None = None  # None: no fault for this rank in this attempt
    at_step: int = 0
    poisoned: bool = False  # this step's loss is to be NaN

    @classmethod
    def from_env(cls, environ=os.environ) -> "FaultPlan":
        rank = int(environ.get("RANK", "0"))
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


def install(plan: FaultPlan):
    """Wrap the loop's set_lr and the model's loss to carry out `plan`; returns the undo."""
    import model.model_minimind as model_module
    import trainer.loop as loop

    set_lr, loss = loop.set_lr, model_module.causal_lm_loss

    def set_lr_then_fault(optimizer, optim, step, total_steps):
        plan.before_step(step)
        return set_lr(optimizer, optim, step, total_steps)

    def poisoned_loss(*args, **kwargs):
        value = loss(*args, **kwargs)
        return value * math.nan if plan.poisoned else value

    loop.set_lr, model_module.causal_lm_loss = set_lr_then_fault, poisoned_loss

    def undo():
        loop.set_lr, model_module.causal_lm_loss = set_lr, loss
    return undo


def install_from_env(environ=os.environ):
    """install() the plan the environment holds, if it holds one; returns the undo (or None)."""
    if environ.get("MINIMIND_FAULT_AT_STEP") is None:
        return None
    return install(FaultPlan.from_env(environ))
