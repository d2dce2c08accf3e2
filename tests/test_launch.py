"""train_pretrain.py under every launcher users reach for, on the demo corpus, CPU/gloo:
torchrun x2, the legacy torch.distributed.launch x2, two single-process "nodes", and
plain python from any working directory (default tokenizer and data resolved against
the repo)."""
import os
import statistics
import subprocess

import pytest

from tests.launch_utils import (
    PYTHON, REPO_ROOT, TINY, TORCHRUN, TRAIN, ensure_demo_corpus, free_port, latest_checkpoint, load_checkpoint,
    out_args, read_metrics, run_env, run_training,
)

PREFIX = "pretrain_64"


def assert_one_set_of_files(run_dir, steps):
    """What one writer (rank 0) leaves after `steps` steps with a single final save: no
    second metrics stream, no leftover temp files, one checkpoint with its record."""
    assert sorted(os.listdir(run_dir / "out")) == [f"{PREFIX}.json", f"{PREFIX}.pth", f"{PREFIX}_metrics.jsonl"]
    step_file = f"{PREFIX}_resume_step{steps:07d}.pth"
    assert sorted(os.listdir(run_dir / "ckpt")) == [f"{PREFIX}_resume.pth", step_file, f"{step_file}.json"]
    assert os.readlink(run_dir / "ckpt" / f"{PREFIX}_resume.pth") == step_file
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, steps + 1))


# ---------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("torchrun")
    result = run_training(2, [*TINY, *out_args(run_dir), "--max_steps", "30"], run_dir)
    assert result.returncode == 0, result.stdout[-3000:]
    return run_dir, result


def test_torchrun_two_processes_loss_goes_down(torchrun_run):
    run_dir, _ = torchrun_run
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) == 30
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first - 0.5, f"loss did not go down: first 5 {first:.3f}, last 5 {last:.3f}"


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
def test_legacy_launcher_two_processes(tmp_path):
    """torch.distributed.launch passes --local-rank=N on the command line."""
    result = run_training(2, [*TINY, *out_args(tmp_path), "--max_steps", "3"], tmp_path, launcher="legacy")
    assert result.returncode == 0, result.stdout[-3000:]
    state = latest_checkpoint(tmp_path)
    assert (state["world_size"], state["global_step"]) == (2, 3)
    assert_one_set_of_files(tmp_path, 3)


# ---------------------------------------------------------------------------- two nodes
def test_two_nodes_of_one_process_train_together(tmp_path):
    port = free_port()
    procs = []
    for node_rank in (0, 1):
        node_dir = tmp_path / f"node{node_rank}"  # each "machine" starts in its own directory
        node_dir.mkdir()
        cmd = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
               "--master_addr=127.0.0.1", f"--master_port={port}",
               str(TRAIN), *TINY, *out_args(tmp_path), "--max_steps", "3"]
        procs.append(subprocess.Popen(cmd, cwd=node_dir, env=run_env(tmp_path), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node_rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node_rank}:\n{output[-3000:]}"
    assert "world_size=2" in outputs[0]
    assert "world_size=" not in outputs[1]  # rank 1 logs nothing of its own
    state = latest_checkpoint(tmp_path)
    assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (2, 3, 8)
    assert_one_set_of_files(tmp_path, 3)
    assert os.listdir(tmp_path / "node0") == os.listdir(tmp_path / "node1") == []


# ---------------------------------------------------------------------------- plain python, any cwd
def test_plain_python_from_any_directory(tmp_path):
    """No launcher, default --tokenizer_path and --data_path: from an unrelated
    directory by absolute path, and from trainer/ as `python train_pretrain.py`."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trainer_dir = REPO_ROOT / "trainer"
    ensure_demo_corpus()  # the two runs below must not race to build it
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
        assert proc.returncode == 0, f"from {cwd}:\n{output[-3000:]}"
        assert "world_size=1" in output and "device=cpu" in output
        state = latest_checkpoint(run_dir)
        assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (1, 2, 4)
        assert_one_set_of_files(run_dir, 2)
    assert os.listdir(elsewhere) == []
    after = {name for name in ("out", "checkpoints", "dataset", "model") if (trainer_dir / name).exists()}
    assert after == before, "the run wrote into trainer/: a default path is resolved against the cwd"
