"""The test harness itself: the fault plan (tests/support/fault_injection.py), whose
MINIMIND_FAULT_* environment, read once at start-up, decides which rank misbehaves at which step
(a restarted group runs clean, a run without it runs the trainer's own functions); and what the
launched tests count as a worker's traceback."""
import math

import pytest
import torch

from tests.support.assertions import worker_tracebacks
from tests.support.fault_injection import FaultPlan, fault_env as fault, install, install_from_env


def poisoned(plan, steps) -> list[bool]:
    """Whether the plan makes each step's loss NaN (the total and every part), through the loss
    install() wraps."""
    import trainer.step as step_module
    from model.model_minimind import MiniMindOutput

    undo, out = install(plan), []
    try:
        for step in range(steps):
            plan.before_step(step)
            total, parts = step_module.training_loss(MiniMindOutput(loss=torch.ones(()), aux_loss=torch.zeros(())), 2)
            nan = [math.isnan(t.item()) for t in (total, *parts.values())]
            assert len(set(nan)) == 1, nan
            out.append(nan[0])
    finally:
        undo()
    return out


def test_fault_plan_is_read_once_and_fires_only_where_planned(monkeypatch):
    """The plan is the environment at start-up: later changes do not move it."""
    environ = {**fault("nan", at=3, rank=1), "RANK": "1"}
    plan, other_rank = FaultPlan.from_env(environ), FaultPlan.from_env({**environ, "RANK": "0"})
    environ["MINIMIND_FAULT_AT_STEP"] = "5"
    assert poisoned(plan, 6) == [False, False, False, True, False, False]
    assert not any(poisoned(other_rank, 6))
    forever = FaultPlan.from_env({**fault("nan_forever", at=2, rank=1), "RANK": "1"})
    assert poisoned(forever, 5) == [False, False, True, True, True]
    restarted = FaultPlan.from_env({**fault("raise", at=0, rank=1), "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    restarted.before_step(0)  # a restarted group runs clean
    with pytest.raises(RuntimeError, match="rank 1 raises at step 2"):
        FaultPlan.from_env({**fault("raise", at=2, rank=1), "RANK": "1"}).before_step(2)


def test_faults_wrap_the_trainers_functions_only_where_planned_and_undo_restores_them():
    import trainer.loop as loop
    import trainer.step as step_module

    own = loop.set_lr, step_module.training_loss
    assert install_from_env({}) is None  # no plan: nothing wrapped
    undo = install_from_env(fault("raise", at=2))
    assert loop.set_lr is not own[0] and step_module.training_loss is not own[1]
    undo()
    assert (loop.set_lr, step_module.training_loss) == own



WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/repo/trainer/train_pretrain.py", line 10, in <module>
RuntimeError: boom"""
# What an elastic agent logged, and survived with rc 0, when the agent hosting the store left first.
AGENT_EXIT_BARRIER = """E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier. Elapsed: 0.01 seconds
E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):
E1201 20:48:28.419000 29741 torch/distributed/elastic/agent/server/api.py:1008]   File "/venv/torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier"""
CHILD_FAILED_REPORT = """Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>"""


def test_a_worker_traceback_is_found_but_not_the_launchers_own():
    assert worker_tracebacks(f"step 1\n{WORKER_TRACEBACK}\n")[0].startswith("Traceback")
    assert worker_tracebacks(f"{AGENT_EXIT_BARRIER}\n{CHILD_FAILED_REPORT}\n") == []
    assert len(worker_tracebacks(f"{AGENT_EXIT_BARRIER}\n{WORKER_TRACEBACK}\n")) == 1
