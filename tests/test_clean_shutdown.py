"""A 2-process job must exit 0 every time. gloo can SIGABRT at exit ("terminate called
without an active exception") when a DDP or FSDP model is still alive at
destroy_process_group; the trainer's cleanup drops it first.

One lucky run proves little, but repetition is what scripts/dev/soak.sh is for: it runs the
multi-process tests N times. So the suite does not repeat a job here; instead every
launched 2-process job that the suite already runs to completion (test_launch,
test_node_local_disks, test_slurm, test_fault_tolerance's torchrun restart, ...) checks
its exit with tests/support/assertions.py's assert_clean_exit: rc 0 and no abort signs in its output.
Jobs whose ranks are forked (tests/support/forked_ranks.py) end in os._exit, before the point
where the abort happens, so they cannot show it. This file keeps one DDP and one FSDP
job under torchrun, side by side, as the shortest run of the property by itself; the
DDP one is the eager run test_compile compares with (the shared_runs fixture)."""
import pytest

from tests.support.assertions import assert_clean_exit
from tests.support.run_outputs import latest_checkpoint
from tests.support.tiny import THREE_STEPS


@pytest.mark.slow
def test_two_process_ddp_and_fsdp_jobs_exit_cleanly(shared_runs):
    runs = shared_runs({"eager_ddp": (2, THREE_STEPS), "eager_fsdp": (2, [*THREE_STEPS, "--parallel", "fsdp"])})
    for name, (_, result) in runs.items():
        assert_clean_exit(result.returncode, result.stdout, name)
    assert latest_checkpoint(runs["eager_ddp"][0])["global_step"] == 3
    assert latest_checkpoint(runs["eager_fsdp"][0], suffix=".dcp")["global_step"] == 3
