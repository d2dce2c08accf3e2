"""Preemption signals and fault injection.

A SIGTERM (spot reclaim, Slurm, `kill`) or SIGINT (Ctrl-C) only raises a flag
here. The training loop all-reduces that flag once per optimizer step, so every
rank sees the request at the same step, saves together and exits together; a
rank that acted alone would leave its peers waiting in a collective.

Fault injection is a testing aid, read from the environment once, by the trainer only:

    MINIMIND_FAULT_AT_STEP=k    global step at which to misbehave
    MINIMIND_FAULT_RANK=r       which rank misbehaves (default 0)
    MINIMIND_FAULT_KIND=kind    kill  - SIGKILL itself before step k (default)
                                raise - raise RuntimeError before step k
                                nan   - make its loss NaN at step k
                                nan_forever - make its loss NaN from step k on

It fires only in the first attempt of a torchrun group (TORCHELASTIC_RESTART_COUNT
is 0 or unset), so a restarted group runs clean.
"""
import os
import signal
import time
from dataclasses import dataclass

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionFlag:
    # One request often arrives twice: Ctrl-C (or Slurm's scancel) signals torchrun and
    # every worker, then torchrun forwards its own copy to the workers. Repeats within
    # this many seconds of the first are that echo, not an impatient user.
    repeat_grace_s = 2.0

    def __init__(self):
        self.signum = 0
        self._first_at = 0.0

    def install(self):
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < self.repeat_grace_s:
            return
        # A second Ctrl-C or SIGTERM later on kills at once, as users expect.
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @property
    def requested(self) -> bool:
        return self.signum != 0


@dataclass(frozen=True)
class FaultPlan:
    """This rank's injected fault, read from the environment once at start-up."""
    kind: str | None = None  # None: no fault for this rank in this attempt
    at_step: int = 0

    @classmethod
    def from_env(cls, rank: int, environ=os.environ) -> "FaultPlan":
        at = environ.get("MINIMIND_FAULT_AT_STEP")
        if at is None or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return cls()
        if rank != int(environ.get("MINIMIND_FAULT_RANK", "0")):
            return cls()
        return cls(environ.get("MINIMIND_FAULT_KIND", "kill"), int(at))

    def _fires(self, global_step: int, kinds) -> bool:
        if self.kind not in kinds:
            return False
        return global_step >= self.at_step if self.kind == "nan_forever" else global_step == self.at_step

    def crash_before(self, global_step: int, rank: int):
        """Die (kill) or raise (raise) before running `global_step`, if planned."""
        if self._fires(global_step, ("kill",)):
            print(f"[fault injection] rank {rank} SIGKILLs itself at step {global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires(global_step, ("raise",)):
            raise RuntimeError(f"[fault injection] rank {rank} raises at step {global_step}")

    def poisons(self, global_step: int) -> bool:
        """Whether this rank's loss is made NaN at `global_step`."""
        return self._fires(global_step, ("nan", "nan_forever"))
