"""Preemption signals and fault injection.

A SIGTERM (spot reclaim, Slurm, `kill`) or SIGINT (Ctrl-C) only raises a flag
here. The training loop all-reduces that flag once per optimizer step, so every
rank sees the request at the same step, saves together and exits together; a
rank that acted alone would leave its peers waiting in a collective.

Fault injection is a testing aid, read from the environment by the trainer only:

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


def _fault_planned(global_step: int, rank: int, kinds) -> bool:
    at = os.environ.get("MINIMIND_FAULT_AT_STEP")
    if at is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    kind = os.environ.get("MINIMIND_FAULT_KIND", "kill")
    if kind not in kinds or rank != int(os.environ.get("MINIMIND_FAULT_RANK", "0")):
        return False
    return global_step >= int(at) if kind == "nan_forever" else global_step == int(at)


def inject_crash(global_step: int, rank: int):
    if _fault_planned(global_step, rank, ("kill",)):
        print(f"[fault injection] rank {rank} SIGKILLs itself at step {global_step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _fault_planned(global_step, rank, ("raise",)):
        raise RuntimeError(f"[fault injection] rank {rank} raises at step {global_step}")


def inject_nan(global_step: int, rank: int) -> bool:
    return _fault_planned(global_step, rank, ("nan", "nan_forever"))
