"""train_pretrain.py under every launcher users reach for, on the demo corpus, CPU/gloo:
torchrun x2, the legacy torch.distributed.launch x2, two single-process "nodes", and
plain python from any working directory (default tokenizer and data resolved against
the repo)."""
import os
import statistics
import subprocess

import pytest

from tests.assertions import assert_clean_exit
from scripts.elastic_agents import agreed_port
from scripts.launching import PYTHON, REPO_ROOT, TORCHRUN, TRAIN
from tests.jobs import JobSpec, run_all, run_env
from tests.run_outputs import (
    checkpoint_name, latest_checkpoint, latest_link_name, load_checkpoint, out_args, read_metrics,
)
from tests.tiny import TINY

PREFIX = "pretrain_64"


def assert_one_set_of_files(run_dir, steps):
    """What one writer (rank 0) leaves after `steps` steps with a single final save: no
    second metrics stream, no leftover temp files, one checkpoint with its record."""
    assert sorted(os.listdir(run_dir / "out")) == [f"{PREFIX}.json", f"{PREFIX}.pth", f"{PREFIX}_metrics.jsonl"]
    step_file = checkpoint_name(steps)
    assert sorted(os.listdir(run_dir / "ckpt")) == [latest_link_name(PREFIX), step_file, f"{step_file}.json"]
    assert os.readlink(run_dir / "ckpt" / latest_link_name(PREFIX)) == step_file
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, steps + 1))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """torchrun x2 for 30 steps and the legacy launcher x2 for 3, side by side:
    {name: (run_dir, Finished)}."""
    root = tmp_path_factory.mktemp("launch")
    legacy = [*TINY, *out_args(root / "legacy"), "--max_steps", "3"]
    jobs = {"torchrun": JobSpec([*TINY, *out_args(root / "torchrun"), "--max_steps", "30"], root / "torchrun", 2,
                                "torchrun"),
            "legacy": JobSpec(legacy, root / "legacy", 2, "legacy")}
    done = run_all(jobs, timeout=240)
    return {name: (jobs[name].run_dir, done[name]) for name in jobs}


# ---------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def torchrun_run(launched):
    run_dir, result = launched["torchrun"]
    assert_clean_exit(result.returncode, result.stdout, "torchrun")
    return run_dir, result


@pytest.mark.slow
def test_torchrun_two_processes_loss_goes_down(torchrun_run):
    run_dir, _ = torchrun_run
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) == 30
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first - 0.5, f"loss did not go down: first 5 {first:.3f}, last 5 {last:.3f}"


@pytest.mark.slow
def test_torchrun_two_processes_writes_weights_and_checkpoint(torchrun_run):
    run_dir, result = torchrun_run
    assert "world_size=2" in result.stdout
    assert_one_set_of_files(run_dir, 30)
    weights = load_checkpoint(run_dir / "out" / f"{PREFIX}.pth")
    assert weights and all(str(t.dtype) == "torch.float16" for t in weights.values())
    state = latest_checkpoint(run_dir)
    assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (2, 30, 8)
    assert len(state["rng"]) == 2


# ---------------------------------------------------------------------------- legacy launcher
@pytest.mark.slow
def test_legacy_launcher_two_processes(launched):
    """torch.distributed.launch passes --local-rank=N on the command line."""
    run_dir, result = launched["legacy"]
    assert_clean_exit(result.returncode, result.stdout, "legacy launcher")
    state = latest_checkpoint(run_dir)
    assert (state["world_size"], state["global_step"]) == (2, 3)
    assert_one_set_of_files(run_dir, 3)


# ---------------------------------------------------------------------------- two nodes
@pytest.mark.slow
def test_two_nodes_of_one_process_train_together(tmp_path):
    procs, outputs = [], []
    with agreed_port() as port:
        try:
            for node_rank in (0, 1):
                node_dir = tmp_path / f"node{node_rank}"  # each "machine" starts in its own directory
                node_dir.mkdir()
                cmd = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
                       "--master_addr=127.0.0.1", f"--master_port={port}",
                       str(TRAIN), *TINY, *out_args(tmp_path), "--max_steps", "3"]
                procs.append(subprocess.Popen(cmd, cwd=node_dir, env=run_env(tmp_path), text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            for proc in procs:
                outputs.append(proc.communicate(timeout=240)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    for node_rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert_clean_exit(proc.returncode, output, f"node {node_rank}")
    assert "world_size=2" in outputs[0]
    assert "world_size=" not in outputs[1]  # rank 1 logs nothing of its own
    state = latest_checkpoint(tmp_path)
    assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (2, 3, 8)
    assert_one_set_of_files(tmp_path, 3)
    assert os.listdir(tmp_path / "node0") == os.listdir(tmp_path / "node1") == []


# ---------------------------------------------------------------------------- plain python, any cwd
@pytest.mark.slow
def test_plain_python_from_any_directory(tmp_path):
    """No launcher, default --tokenizer_path and --data_path: from an unrelated
    directory by absolute path, and from trainer/ as `python train_pretrain.py`."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trainer_dir = REPO_ROOT / "trainer"
    before = {name for name in ("out", "checkpoints", "dataset", "model") if (trainer_dir / name).exists()}
    runs = {}
    for name, cwd, script in [("elsewhere", elsewhere, str(TRAIN)), ("trainer", trainer_dir, "train_pretrain.py")]:
        run_dir = tmp_path / f"run_{name}"
        # Both at once: each is one process, and start-up is most of its time.
        runs[name] = cwd, run_dir, subprocess.Popen(
            [PYTHON, script, *TINY, *out_args(run_dir), "--max_steps", "2"], cwd=cwd, env=run_env(tmp_path),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outputs = {name: proc.communicate(timeout=240)[0] for name, (_, _, proc) in runs.items()}
    finally:
        for _, _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (cwd, run_dir, proc) in runs.items():
        output = outputs[name]
        assert_clean_exit(proc.returncode, output, f"from {cwd}")
        assert "world_size=1" in output and "device=cpu" in output
        state = latest_checkpoint(run_dir)
        assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (1, 2, 4)
        assert_one_set_of_files(run_dir, 2)
    assert os.listdir(elsewhere) == []
    after = {name for name in ("out", "checkpoints", "dataset", "model") if (trainer_dir / name).exists()}
    assert after == before, "the run wrote into trainer/: a default path is resolved against the cwd"
