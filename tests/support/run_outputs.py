"""What a test run left behind: the flags that say where (out_args), its metrics rows and
its checkpoints, named as the trainer names them (trainer/config.py, trainer/checkpoint.py)."""
import json
import os
import re
from pathlib import Path

import torch

from trainer.checkpoint import latest_path, step_path
from trainer.config import metrics_path

PREFIX = "pretrain_64"  # the tiny runs' --save_weight pretrain, --hidden_size 64


def out_args(run_dir) -> list[str]:
    return ["--save_dir", str(Path(run_dir) / "out"), "--checkpoint_dir", str(Path(run_dir) / "ckpt")]


def read_metrics(run_dir, prefix=PREFIX, kind="train") -> list[dict]:
    """Rows of `kind` from the run's metrics file, in file order."""
    with open(metrics_path(Path(run_dir) / "out", prefix)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if row.get("kind") == kind]


def checkpoint_path(run_dir, step: int, prefix=PREFIX, sharded=False) -> Path:
    """The run's resume checkpoint of `step`."""
    return Path(step_path(str(Path(run_dir) / "ckpt"), prefix, step, sharded))


def checkpoint_name(step: int, prefix=PREFIX, sharded=False) -> str:
    return checkpoint_path(".", step, prefix, sharded).name


def latest_link(run_dir, prefix=PREFIX, sharded=False) -> Path:
    """The link the trainer points at the run's newest checkpoint."""
    return Path(latest_path(str(Path(run_dir) / "ckpt"), prefix, sharded))


def latest_link_name(prefix=PREFIX, sharded=False) -> str:
    return latest_link(".", prefix, sharded).name


def checkpoint_steps(run_dir, prefix=PREFIX, sharded=False) -> list[int]:
    """The steps of the run's resume checkpoints (complete or not), in order."""
    pattern = re.escape(checkpoint_name(0, prefix, sharded)).replace("0000000", r"(\d+)")
    folder = Path(run_dir) / "ckpt"
    names = os.listdir(folder) if folder.exists() else []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(pattern, n)))


def load_checkpoint(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def latest_checkpoint(run_dir, prefix=PREFIX, suffix=".pth") -> dict:
    """The newest resume checkpoint; for a sharded (.dcp) one, its trainer state."""
    path = latest_link(run_dir, prefix, sharded=suffix == ".dcp")
    return load_checkpoint(path / "trainer_state.pt" if suffix == ".dcp" else path)
