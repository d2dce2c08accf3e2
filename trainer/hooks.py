"""Where a test reaches into the loop: a StepHooks object sees each optimizer step before it
runs and each micro-batch's loss before its backward pass. A normal run has the no-op
hooks below. The fault-injection tests (tests/fault_injection.py) install theirs through
the environment, which also reaches ranks that torchrun, SLURM or an elastic agent start:

    MINIMIND_STEP_HOOKS=package.module:factory    factory(rank) -> the hooks of that rank
"""
import importlib
import os

HOOKS_VARIABLE = "MINIMIND_STEP_HOOKS"


class StepHooks:
    """No-op hooks; a test's subclass overrides what it needs."""

    def before_step(self, global_step: int):
        """Called before optimizer step `global_step` (counted from 0) starts."""

    def loss(self, loss):
        """The loss a micro-batch back-propagates."""
        return loss


def load_step_hooks(rank: int, environ=os.environ) -> StepHooks:
    """The hooks named by MINIMIND_STEP_HOOKS, or the no-op ones."""
    spec = environ.get(HOOKS_VARIABLE)
    if not spec:
        return StepHooks()
    module, _, factory = spec.partition(":")
    return getattr(importlib.import_module(module), factory)(rank)
