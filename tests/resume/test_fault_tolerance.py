"""Never lose a run: a killed rank, a torchrun restart, a preemption signal, a NaN
and a rank that raises, each on a 2-process CPU/gloo job (tiny model): under torchrun
where the launcher takes part (restarts, signals to it, its report of a failed rank),
else as ranks forked from the preloaded trainer (tests/support/forked_ranks.py).

Exit codes observed (torch 2.x torchrun, gloo, CPU):
  * the trainer, on SIGTERM / SIGINT: saves at the next step, then exits 128+signum
    (143 / 130); shown on a plain `python` run, whose rc we see directly;
  * torchrun after SIGTERM or SIGINT to it: 1 (it re-raises SignalException after
    forwarding the signal to its workers and waiting for them);
  * torchrun when a worker is SIGKILLed, raises, or exits 2 (user error): 1, with a
    ChildFailedError report naming the rank, exit code and pid of the first failure.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.support.assertions import assert_bitwise_equal, assert_clean_exit, assert_same_state, worker_tracebacks
from scripts.dev.launching import PYTHON, TRAIN, children
from tests.support.jobs import JobSpec, ProcessJob, run_all, run_trainer
from tests.support.fault_injection import fault_env
from tests.support.run_outputs import (
    checkpoint_name, checkpoint_path, checkpoint_steps, latest_checkpoint, latest_link_name, load_checkpoint, out_args,
)
from tests.support.tiny import TINY
from trainer.checkpoint import verify_checkpoint

pytestmark = pytest.mark.slow  # every test here launches processes

N, K, SAVE = 12, 6, 4
BASE = [*TINY, "--max_steps", str(N), "--save_interval", str(SAVE)]


def fault(kind, at=K, rank=1) -> dict:
    return fault_env(kind, at, rank)


ckpt_steps = checkpoint_steps

# A signalled run must have saved and exited before SLURM's KillWait (30 s by default) ends
# in SIGKILL. Alone it takes 1 to 2 s; the bound is the real deadline, not a multiple of
# this machine's speed, so a loaded CI machine cannot fail it by chance.
SAVE_GRACE_S = 30


def ckpt_at(run_dir, step) -> dict:
    return load_checkpoint(checkpoint_path(run_dir, step))


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def train_lines(output) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^epoch \d+/\d+ step (\d+)/", output, re.M)]


NAN_K, BAD = 3, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The jobs that need no other job's result, run two at a time: {name: (Finished, run_dir)}."""
    root = tmp_path_factory.mktemp("fault")
    # Forked ranks (tests/support/forked_ranks.py), except where torchrun's restart is the subject.
    jobs = {
        "uninterrupted": JobSpec([*BASE, *out_args(root / "uninterrupted")], root / "uninterrupted", nproc=2,
                                 mode="forked"),
        "killed": JobSpec([*BASE, *out_args(root / "killed")], root / "killed", nproc=2, mode="forked",
                          env=fault("kill")),
        # With a DataLoader worker per rank: the restart must take them down with their ranks.
        "restarted": JobSpec([*BASE, *out_args(root / "restarted"), "--from_resume", "1", "--num_workers", "1"],
                             root / "restarted", nproc=2, mode="torchrun", env=fault("kill"),
                             launcher_args=("--max-restarts=3",)),
        "nan": JobSpec([*TINY, *out_args(root / "nan"), "--max_steps", str(NAN_K + 2), "--save_interval", "1"],
                       root / "nan", nproc=2, mode="forked", env=fault("nan", at=NAN_K)),
        "nan_forever": JobSpec([*TINY, *out_args(root / "nan_forever"), "--max_steps", "50", "--save_interval", "2",
                                "--max_bad_steps", str(BAD)], root / "nan_forever", nproc=2, mode="forked",
                               env=fault("nan_forever", at=NAN_K)),
    }
    results = run_all(jobs, timeout=240)
    return {name: (results[name], jobs[name].run_dir) for name in jobs}


@pytest.fixture(scope="module")
def uninterrupted(runs):
    result, run = runs["uninterrupted"]
    assert_clean_exit(result.returncode, result.stdout, "uninterrupted")
    final = latest_checkpoint(run)
    assert final["global_step"] == N
    return final


# ---------------------------------------------------------------------------- 1. kill + manual resume
def test_killed_rank_then_resume_is_bitwise_identical(runs, uninterrupted):
    killed, run = runs["killed"]
    assert killed.returncode not in (0, None), killed.stdout[-3000:]
    assert f"[fault injection] rank 1 SIGKILLs itself at step {K}" in killed.stdout
    assert ckpt_steps(run) == [SAVE], "only the save before the kill exists"

    resumed = run_trainer([*BASE, *out_args(run), "--from_resume", "1"], run, nproc=2, mode="forked", timeout=180)
    assert_clean_exit(resumed.returncode, resumed.stdout, "resumed")
    assert f"{checkpoint_name(SAVE)} at step {SAVE}/{N}" in resumed.stdout
    assert train_lines(resumed.stdout)[0] == SAVE + 1
    final = latest_checkpoint(run)
    assert final["global_step"] == N and final["tokens_seen"] == uninterrupted["tokens_seen"]
    assert_bitwise_equal(final["model"], uninterrupted["model"])
    assert_same_state(final["optimizer"], uninterrupted["optimizer"], "optimizer")


# ---------------------------------------------------------------------------- 2. torchrun restarts by itself
def test_torchrun_max_restarts_recovers_bitwise_identical(runs, uninterrupted):
    result, run = runs["restarted"]
    assert_clean_exit(result.returncode, result.stdout, "restarted job")
    assert f"[fault injection] rank 1 SIGKILLs itself at step {K}" in result.stdout
    assert f"{checkpoint_name(SAVE)} at step {SAVE}/{N}" in result.stdout  # the restarted group
    final = latest_checkpoint(run)
    assert final["global_step"] == N
    assert_bitwise_equal(final["model"], uninterrupted["model"])
    assert_same_state(final["optimizer"], uninterrupted["optimizer"], "optimizer")


# ---------------------------------------------------------------------------- 3. preemption
PREEMPT_SAVE = 20


def _start(flags, run_dir, nproc=2, new_session=False, env=None) -> ProcessJob:
    """A launched job (torchrun for 2 processes, plain python for 1): its Popen takes the signals."""
    return ProcessJob(JobSpec(flags, run_dir, nproc, "torchrun" if nproc > 1 else "python", env), new_session)


def _wait_for_step(job, run_dir, step, timeout=120) -> int:
    """Poll the metrics file until it logs `step` or later; return the last logged step."""
    metrics = Path(run_dir) / "out" / "pretrain_64_metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.poll() is not None:
            pytest.fail(f"the run ended early (rc {job.returncode}):\n{job.output()[-3000:]}")
        if metrics.exists():
            rows = [line for line in metrics.read_text().splitlines() if line.strip().endswith("}")]
            if rows and int(re.search(r'"step": (\d+)', rows[-1]).group(1)) >= step:
                return int(re.search(r'"step": (\d+)', rows[-1]).group(1))
        time.sleep(0.1)
    job.kill()
    pytest.fail(f"no progress to step {step} within {timeout}s")


def _signal_and_wait(job, send, timeout=SAVE_GRACE_S):
    """Deliver the signal, return (rc, output, seconds to exit)."""
    start = time.monotonic()
    send()
    if job.wait(timeout) is None:
        pytest.fail(f"no exit within {timeout}s of the signal:\n{job.output()[-3000:]}")
    return job.returncode, job.output(), time.monotonic() - start


def _saved_step(output) -> int:
    match = re.search(r"preempted: saved step (\d+) to", output)
    assert match, f"no preemption save reported:\n{output[-3000:]}"
    return int(match.group(1))


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The 2-process job, SIGTERMed (torchrun's pid only, as a scheduler does) mid-run."""
    run = tmp_path_factory.mktemp("preempted")
    args = [*TINY, *out_args(run), "--max_steps", "100000", "--save_interval", str(PREEMPT_SAVE)]
    job = _start(args, run)
    seen = _wait_for_step(job, run, PREEMPT_SAVE + 3)
    rc, output, seconds = _signal_and_wait(job, lambda: job.proc.send_signal(signal.SIGTERM))
    return dict(run=run, args=args, seen=seen, rc=rc, output=output, seconds=seconds)


def test_sigterm_saves_the_current_step_and_exits_promptly(preempted):
    rc, output, seen = preempted["rc"], preempted["output"], preempted["seen"]
    assert rc == 1, output[-3000:]  # torchrun's rc after a forwarded SIGTERM; the workers exit 143
    assert preempted["seconds"] < 15, f"took {preempted['seconds']:.1f}s to exit"
    saved = _saved_step(output)
    # Nothing logged before the signal is lost, and the save is beyond the last periodic one.
    assert saved >= seen > PREEMPT_SAVE
    steps = ckpt_steps(preempted["run"])
    assert steps[-1] == saved and all(s % PREEMPT_SAVE == 0 for s in steps[:-1])
    ckpt, name = preempted["run"] / "ckpt", checkpoint_name(saved)
    assert os.readlink(ckpt / latest_link_name()) == name
    assert verify_checkpoint(str(ckpt / name))["global_step"] == saved
    assert output.count("preempted: saved step") == 1  # rank 0 only


def test_resume_after_sigterm_continues_after_the_saved_step(preempted):
    saved = _saved_step(preempted["output"])
    run = preempted["run"]
    args = [a if a != "100000" else str(saved + 2) for a in preempted["args"]]
    resumed = run_trainer([*args, "--from_resume", "1"], run, nproc=2, mode="forked", timeout=180)
    assert_clean_exit(resumed.returncode, resumed.stdout, "resumed")
    assert f"at step {saved}/{saved + 2}" in resumed.stdout
    assert train_lines(resumed.stdout) == [saved + 1, saved + 2]
    assert latest_checkpoint(run)["global_step"] == saved + 2


@pytest.fixture(scope="module")
def single_process_signalled(tmp_path_factory):
    """Two plain `python` runs side by side (one process each), one SIGTERMed, one SIGINTed
    after step 3: {signame: (run_dir, rc, output, seconds to exit)}."""
    started = {}
    try:
        for signame in ("SIGTERM", "SIGINT"):
            run = tmp_path_factory.mktemp(signame)
            # No periodic save: whichever run waits longer must still hold the signal's save only.
            args = [*TINY, *out_args(run), "--max_steps", "100000", "--save_interval", "100000"]
            started[signame] = run, _start(args, run, nproc=1)
        results = {}
        for signame, (run, job) in started.items():
            _wait_for_step(job, run, 3)
            results[signame] = (run, *_signal_and_wait(job, lambda: job.proc.send_signal(getattr(signal, signame))))
        return results
    finally:
        for _, job in started.values():
            if job.poll() is None:
                job.kill()


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_single_process_exit_code_is_128_plus_signal(single_process_signalled, signame, code):
    """Without torchrun in between, the trainer's own exit code is visible."""
    run, rc, output, seconds = single_process_signalled[signame]
    assert rc == code, output[-3000:]
    assert seconds < SAVE_GRACE_S
    assert ckpt_steps(run) == [_saved_step(output)]
    assert "Traceback" not in output


def test_ctrl_c_to_the_whole_torchrun_process_group_saves(tmp_path):
    """A terminal's Ctrl-C (or Slurm's scancel) signals torchrun and both workers, and
    torchrun then forwards its own SIGINT: that echo must not kill the workers before
    they save. The echo is repeated 50 ms later, as a loaded machine delivers it."""
    args = [*TINY, *out_args(tmp_path), "--max_steps", "100000", "--save_interval", "1000"]
    job = _start(args, tmp_path, new_session=True)
    seen = _wait_for_step(job, tmp_path, 3)
    workers = children(job.proc.pid)
    assert len(workers) == 2

    def ctrl_c_then_echo():
        os.killpg(job.proc.pid, signal.SIGINT)
        time.sleep(0.05)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    rc, output, seconds = _signal_and_wait(job, ctrl_c_then_echo)
    assert rc != 0 and seconds < SAVE_GRACE_S, output[-3000:]
    saved = _saved_step(output)
    assert saved >= seen and ckpt_steps(tmp_path) == [saved]


def test_a_repeated_signal_is_an_echo_at_first_and_kills_later(tmp_path):
    code = f"""if True:
        import os, signal, sys, time
        sys.path.insert(0, {str(Path(TRAIN).parents[1])!r})
        from trainer.loop import PreemptionFlag
        flag = PreemptionFlag()
        flag.repeat_grace_s = 0.5
        flag.install()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the echo: ignored
        time.sleep(0.1)
        print("saving", flag.signum, flush=True)
        time.sleep(0.6)
        os.kill(os.getpid(), signal.SIGINT)  # the user insists: die now
        time.sleep(5)
        print("still alive", flush=True)
    """
    result = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=30)
    assert result.stdout.split() == ["saving", str(int(signal.SIGINT))], result.stdout
    assert result.returncode == -signal.SIGINT


# ---------------------------------------------------------------------------- 6. NaN / Inf
def test_nan_on_one_rank_skips_that_update_everywhere(runs):
    result, run = runs["nan"]
    k = NAN_K
    assert_clean_exit(result.returncode, result.stdout, "nan")
    assert result.stdout.count("update skipped") == 1
    assert f"step {k + 1}: non-finite loss or gradient norm on some rank; update skipped" in result.stdout
    assert ckpt_steps(run) == [k, k + 1, k + 2]
    before, skipped, after = (ckpt_at(run, s) for s in (k, k + 1, k + 2))
    # The skipped step changed nothing (weights, Adam moments and step count) ...
    assert_bitwise_equal(skipped["model"], before["model"])
    assert_same_state(skipped["optimizer"]["state"], before["optimizer"]["state"], "optimizer state")
    # ... and training went on, finite on rank 1 too (its NaN gradients were never applied:
    # a NaN weight on any rank would make every later all-reduced gradient NaN).
    assert not torch.equal(after["model"]["model.embed_tokens.weight"], skipped["model"]["model.embed_tokens.weight"])
    assert all_finite(after["model"])


def test_nan_forever_aborts_after_max_bad_steps_and_keeps_good_checkpoints(runs):
    result, run = runs["nan_forever"]
    out = result.stdout
    assert result.returncode not in (0, None), out[-3000:]
    message = f"{BAD} consecutive non-finite steps (--max_bad_steps {BAD})"
    assert out.count(message) == 1, out[-3000:]
    assert out.count("update skipped") == BAD
    assert not worker_tracebacks(out)
    # Saves at 2 (good) and 4 (after one skipped update: still finite); none at 6, where it aborted.
    assert ckpt_steps(run) == [2, 4]
    for step in (2, 4):
        state = verify_checkpoint(str(run / "ckpt" / checkpoint_name(step)))
        assert all_finite(state["model"])
    assert os.readlink(run / "ckpt" / latest_link_name()) == checkpoint_name(4)


# ---------------------------------------------------------------------------- 7. a rank raises
def test_a_rank_that_raises_ends_the_job_quickly_and_is_named(tmp_path):
    """Rank 1 raises before step 4 while rank 0 waits in that step's all-reduce: the job
    must end at once, not after --dist_timeout. Alone it ends in about 1.5 s; the generous
    timeout keeps "at once" (under a third of it) apart from "after the timeout" on a
    loaded CI machine, where the teardown can take several times as long."""
    timeout_s = 120
    args = [*TINY, *out_args(tmp_path), "--max_steps", "50", "--save_interval", "1000",
            "--dist_timeout", str(timeout_s)]
    job = _start(args, tmp_path, env=fault("raise", at=3))
    deadline, step3_at = time.monotonic() + timeout_s + 60, None
    while job.poll() is None and time.monotonic() < deadline:  # timestamp the last good step as it is logged
        if step3_at is None and re.search(r"^epoch \d+/\d+ step 3/", job.output(), re.M):
            step3_at = time.monotonic()
        time.sleep(0.05)
    if job.poll() is None:
        job.kill()
    seconds = time.monotonic() - step3_at if step3_at else None
    out = job.output()
    assert job.returncode not in (0, -signal.SIGKILL, None), out[-3000:]
    assert seconds is not None and seconds < timeout_s / 3, f"{seconds}s from the fault to the exit:\n{out[-3000:]}"
    assert "RuntimeError: [fault injection] rank 1 raises at step 3" in out
    root_cause = out[out.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), out[-3000:]


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def test_a_hung_rank_leaves_torchrun_s_report_naming_the_waiting_rank_s_line(tmp_path):
    """Rank 1 stops (SIGSTOP) after step 3, as a hung process does; rank 0 waits out --dist_timeout
    in the next all-reduce and stops with its one line, which torchrun's failure report names as
    the root cause from rank 0's error file, not "error_file: <N/A>"."""
    args = [*TINY, *out_args(tmp_path), "--max_steps", "100000", "--save_interval", "100000",
            "--dist_timeout", "10"]  # short, yet a loaded machine's start-up skew stays within it
    job = _start(args, tmp_path)
    _wait_for_step(job, tmp_path, 3)
    [hung] = [pid for pid in children(job.proc.pid) if _rank_of(pid) == 1]
    os.kill(hung, signal.SIGSTOP)
    try:  # until torchrun stops the group: a stopped process acts on its SIGTERM only when killed, 30 s later
        deadline = time.monotonic() + 120
        while "closing signal" not in job.output() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.kill(hung, signal.SIGKILL)
    assert job.wait(60) not in (0, None)
    out = job.output()
    [line] = [line for line in out.splitlines() if line.startswith("error: lost a peer process")]
    assert line.endswith("no torchrun restart is left (--max-restarts); relaunch with --from_resume 1"), line
    root_cause = out[out.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)", root_cause), out[-3000:]
    assert re.search(r"error_file\s*:\s*/\S+", root_cause), out[-3000:]
    assert re.search(rf"traceback\s*:\s*{re.escape(line)}\n", root_cause), out[-3000:]
