"""--use_wandb must work with no API key and no network: offline, and said so; a resume goes on
with the same wandb run, whose charts are drawn against the tokens trained."""
import re

from tests.support.jobs import run_trainer
from tests.support.run_outputs import checkpoint_name, out_args
from tests.support.tiny import TINY
from tests.support.wandb_records import history_rows, step_metrics


def test_wandb_without_key_logs_offline_and_resumes_the_same_run(tmp_path):
    """The resume redoes steps 3 and 4 (the checkpoint at step 4 is gone): wandb gets their rows
    again, at the same tokens trained as their first logging, the x axis of every chart."""
    no_key = {"WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_DIR": ""}
    run = [*TINY, *out_args(tmp_path), "--max_steps", "4", "--save_interval", "2", "--use_wandb"]
    first = run_trainer(run, tmp_path, env=no_key)
    assert first.returncode == 0, first.stdout[-3000:]
    run_id = re.search(r"wandb: run (\w+) \(offline\)", first.stdout).group(1)
    for path in (tmp_path / "ckpt").glob(f"{checkpoint_name(4)}*"):
        path.unlink()
    resumed = run_trainer([*run, "--from_resume", "1"], tmp_path, env=no_key)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"wandb: run {run_id} (offline)" in resumed.stdout
    first_file, resumed_file = sorted((tmp_path / "out" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    logged = {}
    for path in (first_file, resumed_file):
        assert step_metrics(path) == {"tokens_seen": "", "*": "tokens_seen"}, path
        logged[path] = {row["step"]: row["tokens_seen"] for row in history_rows(path) if "loss" in row}
    assert list(logged[first_file]) == [1, 2, 3, 4] and list(logged[resumed_file]) == [3, 4]
    assert all(logged[resumed_file][step] == logged[first_file][step] for step in (3, 4))
