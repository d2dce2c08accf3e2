"""The fault plan (trainer/resilience.py): the MINIMIND_FAULT_* environment, read once at
start-up, decides which rank misbehaves at which step, and a restarted group runs clean."""
import pytest

from tests.fault_helpers import fault_env as fault
from trainer.resilience import FaultPlan


def test_fault_plan_is_read_once_and_fires_only_where_planned(monkeypatch):
    """The plan is the environment at start-up: later changes do not move it."""
    for key, value in fault("nan", at=3, rank=1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    plan, other_rank = FaultPlan.from_env(1), FaultPlan.from_env(0)
    monkeypatch.setenv("MINIMIND_FAULT_AT_STEP", "5")
    assert [plan.poisons(s) for s in range(6)] == [False, False, False, True, False, False]
    assert not any(other_rank.poisons(s) for s in range(6))
    forever = FaultPlan.from_env(1, fault("nan_forever", at=2, rank=1))
    assert [forever.poisons(s) for s in range(5)] == [False, False, True, True, True]
    restarted = FaultPlan.from_env(1, {**fault("raise", at=0, rank=1), "TORCHELASTIC_RESTART_COUNT": "1"})
    restarted.crash_before(0, 1)  # a restarted group runs clean
    with pytest.raises(RuntimeError, match="rank 1 raises at step 2"):
        FaultPlan.from_env(1, fault("raise", at=2, rank=1)).crash_before(2, 1)
