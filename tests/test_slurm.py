"""scripts/slurm/pretrain.sbatch on a real one-node SLURM started on this machine
(scripts/slurm/local_cluster.sh; .ci/run installs the packages). Skipped, with the
reason, where SLURM is missing or cannot run."""
import os
import re
import shutil
import subprocess
import time

import pytest
import torch

from tests.support.assertions import ABORT_SIGNS, assert_bitwise_equal, assert_clean_exit
from tests.support import REPO_ROOT
from scripts.dev.launching import TORCHRUN
from tests.support.jobs import JobSpec, start_trainer
from tests.support.run_outputs import latest_checkpoint, out_args
from tests.support.tiny import TINY

SBATCH = REPO_ROOT / "scripts" / "slurm" / "pretrain.sbatch"
CLUSTER = REPO_ROOT / "scripts" / "slurm" / "local_cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
# Overrides of the script's #SBATCH lines for this CPU-only one-node cluster.
LOCAL = ["--partition=debug", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=20"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running local cluster; its daemons are stopped afterwards."""
    missing = [d for d in DAEMONS if not shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if missing:
        reason = os.environ.get("SLURM_INSTALL_ERROR") or "run scripts/slurm/local_cluster.sh install as root"
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): {reason}")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=120)
    try:
        if started.returncode != 0:
            pytest.skip(f"SLURM cannot run here: {(started.stderr or started.stdout).strip()}")
        yield str(state / "slurm.conf")
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=60)


def slurm_env(conf, run_dir) -> dict:
    env = dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", TMPDIR=str(run_dir), PYTHONUNBUFFERED="1",
               NPROC_PER_NODE="2", MINIMIND_REPO=str(REPO_ROOT), TORCHRUN=TORCHRUN[0])
    return {k: v for k, v in env.items() if not k.startswith(("MINIMIND_FAULT", "SLURM_JOB", "SLURM_STEP"))}


def submit(conf, run_dir, train_args) -> tuple[str, dict]:
    env = slurm_env(conf, run_dir)
    if len(TORCHRUN) > 1:  # no torchrun script next to this python: run the module
        pytest.skip("needs the torchrun script next to the test's python")
    out = subprocess.run(["sbatch", "--parsable", *LOCAL, str(SBATCH), *train_args], cwd=run_dir, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0], env


def job_state(job, env) -> tuple[str, str]:
    """(state, reason) from squeue; ("", "") once the job has left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True, text=True,
                         timeout=30).stdout.split()
    return (out[0], out[1]) if len(out) >= 2 else ("", "")


def job_log(run_dir, job) -> str:
    path = run_dir / f"minimind-pretrain-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(job, env, run_dir, done, timeout, what):
    """Poll every half second until done(log) is true; cancel the job and fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(job_log(run_dir, job)):
            return
        state, reason = job_state(job, env)
        # A requeued job waits for a begin time some minutes ahead; start it now.
        if state == "PENDING" and reason == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, timeout=30)
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, timeout=30)
    pytest.fail(f"no {what} within {timeout}s; job log:\n{job_log(run_dir, job)[-4000:]}")


def finished(job, env):
    return lambda log: not job_state(job, env)[0]


@pytest.mark.slow
def test_sbatch_trains_like_torchrun_with_two_processes(slurm, tmp_path):
    steps = 20
    args = [*TINY, "--max_steps", str(steps), "--save_interval", "10", "--global_batch_size", "8"]
    job, env = submit(slurm, tmp_path, [*args, *out_args(tmp_path)])
    # The same 2 processes under a plain torchrun, started meanwhile: the same run, bit for bit.
    reference = tmp_path / "reference"
    reference.mkdir()
    plain = start_trainer(JobSpec([*args, *out_args(reference)], reference, nproc=2, mode="torchrun"))
    try:
        wait_for(job, env, tmp_path, finished(job, env), 300, "finished job")
        assert_clean_exit(plain.wait(timeout=240), plain.output(), "plain torchrun")
    finally:
        if plain.poll() is None:
            plain.kill()
    log = job_log(tmp_path, job)
    assert f"done: {steps} steps" in log, log[-4000:]
    assert "1 node(s) x 2 process(es)" in log
    assert "world_size=2 micro_batch=4 accumulation=1 global_batch=8" in log
    assert "Traceback" not in log and not [sign for sign in ABORT_SIGNS if sign in log], log[-4000:]

    final = latest_checkpoint(tmp_path)
    assert final["global_step"] == steps
    assert_bitwise_equal(final["model"], latest_checkpoint(reference)["model"])
    weights = torch.load(tmp_path / "out" / "pretrain_64.pth", map_location="cpu", weights_only=True)
    assert_bitwise_equal(weights, {k: v.half() for k, v in final["model"].items()})


@pytest.mark.slow
def test_requeue_saves_at_the_current_step_and_resumes_there(slurm, tmp_path):
    """`scontrol requeue` mid-run: every rank saves at the step it is in (not just the
    last periodic checkpoint), the job comes back and finishes from that step."""
    steps, every = 160, 50  # the requeue comes after step 55: 100 steps (~7 s) of room
    args = [*TINY, "--max_steps", str(steps), "--save_interval", str(every), *out_args(tmp_path)]
    job, env = submit(slurm, tmp_path, args)

    def past_first_save(log):
        logged = [int(s) for s in re.findall(r"^epoch \d+/\d+ step (\d+)/", log, re.M)]
        return bool(logged) and max(logged) > every + 5
    wait_for(job, env, tmp_path, past_first_save, 300, f"step {every + 5}")
    requeued = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True, timeout=30)
    assert requeued.returncode == 0, requeued.stderr
    wait_for(job, env, tmp_path, lambda log: "(restart 1)" in log, 300, "restart after the requeue")
    wait_for(job, env, tmp_path, finished(job, env), 480, "finished job after the requeue")

    log = job_log(tmp_path, job)
    saved = re.findall(r"preempted: saved step (\d+) to", log)
    assert len(saved) == 1, log[-4000:]
    saved = int(saved[0])
    before = log[:log.index("(restart 1)")]
    last_logged = max(int(s) for s in re.findall(r"^epoch \d+/\d+ step (\d+)/", before, re.M))
    assert saved >= last_logged > every, "the save is at the step where the job stopped"
    assert re.findall(r"resumed from \S+ at step (\d+)/", log) == [str(saved)], log[-4000:]
    assert f"done: {steps} steps" in log
    assert latest_checkpoint(tmp_path)["global_step"] == steps
