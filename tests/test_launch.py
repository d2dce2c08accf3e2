"""train_pretrain.py under every launcher users reach for, on the demo corpus, CPU/gloo:
torchrun x2, the legacy torch.distributed.launch x2, two single-process "nodes", and
plain python from any working directory (default tokenizer and data resolved against
the repo)."""
import os
import statistics

import pytest

from tests.support.assertions import assert_clean_exit
from tests.support import REPO_ROOT
from scripts.dev.launching import TRAIN
from tests.support.jobs import JobSpec, run_all, run_nodes
from tests.support.run_outputs import (
    checkpoint_name, latest_checkpoint, latest_link_name, load_checkpoint, out_args, read_metrics,
)
from tests.support.tiny import TINY

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
    nodes = [tmp_path / "node0", tmp_path / "node1"]  # each "machine" starts in its own directory
    for node in nodes:
        node.mkdir()
    # Temp files beside the nodes' folders, so that what lands in them shows below.
    results = run_nodes([*TINY, *out_args(tmp_path), "--max_steps", "3"], nodes, env={"TMPDIR": str(tmp_path)})
    for node_rank, result in enumerate(results):
        assert_clean_exit(result.returncode, result.stdout, f"node {node_rank}")
    assert "world_size=2" in results[0].stdout
    assert "world_size=" not in results[1].stdout  # rank 1 logs nothing of its own
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
    # Both at once: each is one process, and start-up is most of its time.
    specs = {name: JobSpec([*TINY, *out_args(tmp_path / f"run_{name}"), "--max_steps", "2"], tmp_path / f"run_{name}",
                           script=script, cwd=cwd)
             for name, cwd, script in [("elsewhere", elsewhere, TRAIN), ("trainer", trainer_dir, "train_pretrain.py")]}
    for name, result in run_all(specs, timeout=240).items():
        assert_clean_exit(result.returncode, result.stdout, f"from {specs[name].cwd}")
        assert "world_size=1" in result.stdout and "device=cpu" in result.stdout
        state = latest_checkpoint(specs[name].run_dir)
        assert (state["world_size"], state["global_step"], state["samples_per_step"]) == (1, 2, 4)
        assert_one_set_of_files(specs[name].run_dir, 2)
    assert os.listdir(elsewhere) == []
    after = {name for name in ("out", "checkpoints", "dataset", "model") if (trainer_dir / name).exists()}
    assert after == before, "the run wrote into trainer/: a default path is resolved against the cwd"
