"""Where a run's files go, named by its prefix `{save_weight}_{hidden}[_moe]`: the inference
weights and their config in --save_dir (x.pth, x.json), the metrics beside them, and the
resume checkpoints in --checkpoint_dir (trainer/checkpoint.py's step_path)."""
import os
from pathlib import Path

from common.errors import UserError
from model.shape_flags import FLAG_DEFAULTS

WEIGHT_SUFFIXES = (".pth", ".safetensors")


def run_prefix(save_weight: str, hidden_size: int, use_moe) -> str:
    """The name of a run's files: `{save_weight}_{hidden}[_moe]` + .pth, .json, _metrics.jsonl, _resume..."""
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}"


def weights_path(save_dir, prefix: str) -> str:
    """The half-precision inference weights, MiniMind's format (the model config beside them as .json)."""
    return os.path.join(save_dir, f"{prefix}.pth")


def metrics_path(save_dir, prefix: str) -> str:
    """One JSON row per log step and per validation."""
    return os.path.join(save_dir, f"{prefix}_metrics.jsonl")


def default_weight_path(save_dir, hidden_size=None, use_moe=None, save_weight="pretrain") -> Path:
    """Where a default training run with these shape flags left its weights (what the scripts
    read when given no --weight_path)."""
    return Path(weights_path(save_dir, run_prefix(save_weight, hidden_size or FLAG_DEFAULTS["hidden_size"], use_moe)))


def initial_weights(args) -> str | None:
    """The file --from_weight names, or None to start from scratch. A path is taken as it is;
    a plain name is MiniMind's: the weights a stage of that --save_weight saved in --save_dir
    for this shape (pretrain -> {save_dir}/pretrain_{hidden}[_moe].pth), which must exist."""
    value = args.from_weight
    if value is None or value.lower() == "none":
        return None
    if Path(value).suffix in WEIGHT_SUFFIXES or os.sep in value or Path(value).exists():
        return value
    path = weights_path(args.save_dir, run_prefix(value, args.hidden_size, args.use_moe))
    if not Path(path).is_file():
        raise UserError(f"--from_weight {value}: no {path} (a name means {{save_dir}}/{value}_{{hidden}}[_moe].pth, "
                        f"as MiniMind names it): train that stage first, pass the weights file itself, or pass "
                        f"--from_weight none to start from scratch")
    return path
