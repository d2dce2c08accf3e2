"""A 2-process job must exit 0 every time. gloo can SIGABRT at exit ("terminate called
without an active exception") when a DDP or FSDP model is still alive at
destroy_process_group; the trainer's cleanup drops it first.

One lucky run proves little, but repetition is what scripts/soak.sh is for: it runs the
multi-process tests N times. So the suite does not repeat a job here; instead every
2-process job that the suite already runs to completion (test_launch, test_scaling,
test_fault_tolerance, test_compile, test_node_local_disks, ...) checks its exit with
fault_helpers.assert_clean_exit: rc 0 and no abort signs in its output. This file keeps
one DDP and one FSDP job, side by side, as the shortest run of the property by itself."""
import pytest

from tests.fault_helpers import assert_clean_exit, job, run_all
from tests.launch_utils import TINY, ensure_demo_corpus, latest_checkpoint, out_args


@pytest.mark.slow
def test_two_process_ddp_and_fsdp_jobs_exit_cleanly(tmp_path):
    ensure_demo_corpus()
    args = {"ddp": [], "fsdp": ["--parallel", "fsdp"]}
    jobs = {name: job(2, [*TINY, *out_args(tmp_path / name), "--max_steps", "3", *extra], tmp_path / name)
            for name, extra in args.items()}
    for name, result in run_all(jobs, timeout=240).items():
        assert_clean_exit(result.returncode, result.stdout, name)
    assert latest_checkpoint(tmp_path / "ddp")["global_step"] == 3
    assert latest_checkpoint(tmp_path / "fsdp", suffix=".dcp")["global_step"] == 3
