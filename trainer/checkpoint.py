"""Resume checkpoints that survive kills, full disks and corrupt files.

Layout in --checkpoint_dir, for the run prefix `{save_weight}_{hidden}[_moe]`:

    pretrain_512_resume_step0001200.pth        the checkpoint itself (torch.save)
    pretrain_512_resume_step0001200.pth.json   its size and sha256, written after it
    pretrain_512_resume.pth -> ..._step0001200.pth   symlink to the newest, swapped atomically

A file becomes visible only through os.replace of a finished temp file, and the
record comes after the file, so a kill at any moment leaves every earlier
checkpoint intact and the half-written one unrecorded (and therefore skipped).
"""
import glob
import hashlib
import json
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist

from trainer.trainer_utils import Logger, UserError, barrier, broadcast_from_main, is_main_process

FORMAT = "minimind-resume-v1"
REQUIRED_KEYS = {"format", "model", "optimizer", "scaler", "global_step", "epoch", "step_in_epoch",
                 "samples_per_step", "world_size", "model_config", "rng", "tokens_seen"}
# Architecture fields a resumed run must agree on.
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size",
               "num_attention_heads", "num_key_value_heads", "intermediate_size")


def run_prefix(save_weight: str, hidden_size: int, use_moe: bool) -> str:
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}"


def step_path(checkpoint_dir, prefix, global_step) -> str:
    return os.path.join(checkpoint_dir, f"{prefix}_resume_step{global_step:07d}.pth")


def list_checkpoints(checkpoint_dir, prefix) -> list[str]:
    """Step checkpoints of this run, newest first."""
    paths = glob.glob(os.path.join(glob.escape(checkpoint_dir), f"{glob.escape(prefix)}_resume_step*.pth"))
    return sorted(paths, key=_step_of, reverse=True)


def _step_of(path) -> int:
    match = re.search(r"_resume_step(\d+)\.pth$", path)
    return int(match.group(1)) if match else -1


# ---------------------------------------------------------------------------- RNG state
def capture_rng_state() -> dict:
    # numpy's state is stored as a tensor so the checkpoint loads with weights_only=True.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict):
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(obj):
    # random.setstate insists on tuples; a round trip through some loaders yields lists.
    return tuple(_as_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def gather_rng_states() -> list:
    """Every rank's RNG state, on every rank (rank 0 is the one that writes them)."""
    mine = capture_rng_state()
    if not dist.is_initialized():
        return [mine]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


# ---------------------------------------------------------------------------- saving
def _sha256(path, chunk=1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_torch_save(obj, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _point_latest(checkpoint_dir, prefix, target):
    link = os.path.join(checkpoint_dir, f"{prefix}_resume.pth")
    tmp = f"{link}.tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(target), tmp)
    os.replace(tmp, link)


def save_checkpoint(state: dict, checkpoint_dir: str, prefix: str, keep_last: int = 3) -> str | None:
    """Write a resume checkpoint from rank 0; every rank must call this (RNG gather, barrier)."""
    state = dict(state, format=FORMAT, rng=gather_rng_states())
    path = step_path(checkpoint_dir, prefix, state["global_step"])
    if is_main_process():
        os.makedirs(checkpoint_dir, exist_ok=True)
        atomic_torch_save(state, path)
        record = {"size": os.path.getsize(path), "sha256": _sha256(path), "global_step": state["global_step"]}
        _atomic_write_text(f"{path}.json", json.dumps(record))
        _point_latest(checkpoint_dir, prefix, path)
        for old in list_checkpoints(checkpoint_dir, prefix)[max(1, keep_last):]:
            for stale in (old, f"{old}.json"):
                if os.path.exists(stale):
                    os.remove(stale)
    barrier()
    return path


# ---------------------------------------------------------------------------- loading
def verify_checkpoint(path: str) -> dict:
    """Load `path` if its record, checksum and keys check out; raise ValueError saying why not."""
    record_path = f"{path}.json"
    if not os.path.exists(record_path):
        raise ValueError("no size/checksum record (its save was interrupted)")
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        raise ValueError(f"unreadable record {os.path.basename(record_path)}") from None
    size = os.path.getsize(path)
    if size != record.get("size"):
        raise ValueError(f"size {size} bytes, but {record.get('size')} were written (truncated?)")
    if _sha256(path) != record.get("sha256"):
        raise ValueError("sha256 does not match the one recorded at save time (corrupt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"does not unpickle ({type(exc).__name__})") from None
    missing = REQUIRED_KEYS - set(state) if isinstance(state, dict) else REQUIRED_KEYS
    if missing or state.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint (missing {sorted(missing)})")
    return state


def check_config_matches(path: str, saved: dict, current: dict):
    for key in CONFIG_KEYS:
        if saved.get(key) != current.get(key):
            raise UserError(
                f"checkpoint {path} was saved with {key}={saved.get(key)}, but the flags give {key}={current.get(key)}; "
                f"rerun with the flags it was trained with, or point --checkpoint_dir elsewhere to start fresh"
            )


def _choose_checkpoint(checkpoint_dir, prefix, model_config: dict):
    """Rank 0's pick: (path, state) to resume, (None, None) to start fresh; raises UserError to stop."""
    candidates = list_checkpoints(checkpoint_dir, prefix)
    if not candidates:
        # Another prefix (say, a different --hidden_size) with a usable checkpoint means the
        # flags changed, not that this is a new run: say so instead of silently starting over.
        others = glob.glob(os.path.join(glob.escape(checkpoint_dir), "*_resume_step*.pth"))
        for other in sorted(others, key=os.path.getmtime, reverse=True):
            try:
                saved_config = verify_checkpoint(other)["model_config"]
            except ValueError:
                continue
            check_config_matches(other, saved_config, model_config)
        return None, None
    for path in candidates:
        try:
            state = verify_checkpoint(path)
        except ValueError as exc:
            Logger(f"skipping checkpoint {path}: {exc}")
            continue
        check_config_matches(path, state["model_config"], model_config)
        return path, state
    raise UserError(f"--from_resume 1: none of the {len(candidates)} checkpoints in {checkpoint_dir} is usable "
                    f"(see above); move them aside to start fresh")


def load_latest_checkpoint(checkpoint_dir: str, prefix: str, model_config: dict) -> dict | None:
    """The newest verified checkpoint as a state dict on every rank (CPU tensors), or
    None when this run has none. Rank 0 decides and broadcasts its decision, so every
    rank resumes from the same file even if their views of the directory differ."""
    path, state, message = None, None, None
    if is_main_process():
        try:
            path, state = _choose_checkpoint(checkpoint_dir, prefix, model_config)
        except UserError as exc:
            message = str(exc)
    path, message = broadcast_from_main((path, message))
    if message:
        raise UserError(message)
    if path is None:
        return None
    if state is None:
        state = torch.load(path, map_location="cpu", weights_only=True)
    state["path"] = path
    return state


def lm_checkpoint(checkpoint_dir, prefix, model_config=None, state=None, keep_last=3):
    """MiniMind-style entry point: save when `state` is given, otherwise load the latest."""
    if state is not None:
        return save_checkpoint(state, checkpoint_dir, prefix, keep_last)
    return load_latest_checkpoint(checkpoint_dir, prefix, model_config or {})
