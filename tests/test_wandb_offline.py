"""--use_wandb must work with no API key and no network: offline, and said so."""
import re

from tests.support.jobs import run_trainer
from tests.support.run_outputs import out_args
from tests.support.tiny import TINY


def test_wandb_without_key_logs_offline_and_resumes_the_same_run(tmp_path):
    no_key = {"WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_DIR": ""}
    first = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "2", "--use_wandb"], tmp_path, env=no_key)
    assert first.returncode == 0, first.stdout[-3000:]
    run_id = re.search(r"wandb: run (\w+) \(offline\)", first.stdout).group(1)
    assert list((tmp_path / "out" / "wandb").glob(f"offline-run-*-{run_id}"))
    resumed = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "4", "--use_wandb", "--from_resume", "1"],
                          tmp_path, env=no_key)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"wandb: run {run_id} (offline)" in resumed.stdout
