"""Preemption signals: a SIGTERM (spot reclaim, Slurm, `kill`) or SIGINT (Ctrl-C) only
raises a flag here. The training loop all-reduces that flag once per optimizer step, so
every rank sees the request at the same step, saves together and exits together; a rank
that acted alone would leave its peers waiting in a collective."""
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
