"""Where resume checkpoints lie and how one is checked: their names (one per step, and a copy
number where a step number comes twice), their order (newest first), the record beside each,
and the verification of a checkpoint against it. trainer/checkpoint.py writes and picks them."""
import glob
import hashlib
import json
import os
import re

import torch

from trainer.train_state import ModelState

FORMAT = "minimind-resume-v1"
TRAINER_STATE = "trainer_state.pt"


def step_path(checkpoint_dir, prefix, global_step, sharded=False, copy: int = 1) -> str:
    """The checkpoint of `global_step`; copy 2, 3, ...: a later save at a step of the same number
    (CheckpointManager._free_path)."""
    suffix = f"_{copy}" if copy > 1 else ""
    return os.path.join(checkpoint_dir, f"{prefix}_resume_step{global_step:07d}{suffix}{_extension(sharded)}")


STEP_NAME = r"_resume_step(\d+)(?:_(\d+))?\.(?:pth|dcp)$"  # step_path's names: the step, and the copy after the first


def latest_path(checkpoint_dir, prefix, sharded=False) -> str:
    """The link to the newest checkpoint, for people and scripts (a resume picks by the records)."""
    return os.path.join(checkpoint_dir, f"{prefix}_resume{_extension(sharded)}")


def _extension(sharded: bool) -> str:
    return ".dcp" if sharded else ".pth"  # a torch.distributed.checkpoint folder, or one torch.save file


def list_checkpoints(checkpoint_dir, prefix="*") -> list[str]:
    """Step checkpoints (files and DCP folders) of this run, newest first: the latest run's, then
    most tokens trained, as recorded at save time (a step of 2 processes is 2 steps of 1).
    Unrecorded ones (an interrupted save) sort last; they are skipped on load anyway."""
    name = prefix if prefix == "*" else glob.escape(prefix)
    pattern = os.path.join(glob.escape(checkpoint_dir), f"{name}_resume_step*")
    paths = [p for p in glob.glob(pattern) if re.search(STEP_NAME, p)]
    return sorted(paths, key=_progress_of, reverse=True)


def other_shapes(checkpoint_dir, prefix) -> list[str]:
    """Checkpoints of the run names `{save_weight}_{hidden}[_moe]` that differ from `prefix` in
    the shape alone."""
    save_weight = re.sub(r"_\d+(_moe)?$", "", prefix)
    same_name = re.compile(rf"{re.escape(save_weight)}_\d+(_moe)?")
    names = {path: os.path.basename(path).rpartition("_resume_step")[0] for path in list_checkpoints(checkpoint_dir)}
    return [path for path, name in names.items() if name != prefix and same_name.fullmatch(name)]


def orphan_records(checkpoint_dir, prefix) -> list[str]:
    """Records whose checkpoint is not there: a save killed between its record and its rename."""
    pattern = os.path.join(glob.escape(checkpoint_dir), f"{glob.escape(prefix)}_resume_step*.json")
    return [p for p in glob.glob(pattern) if re.search(r"\.(pth|dcp)\.json$", p) and not os.path.lexists(p[:-5])]


def _progress_of(path) -> tuple:
    """(run number, tokens trained, step, copy): a later run's checkpoints first; of two saves of
    the same progress, the later copy."""
    step, copy = re.search(STEP_NAME, path).group(1, 2)
    record = record_of(path) or {}
    tokens = record.get("tokens_seen")
    return (run_number(record), tokens if isinstance(tokens, int) else -1, int(step), int(copy or 1))


def run_number(record: dict) -> int:
    number = record.get("run_number")
    return number if isinstance(number, int) else 0


def record_of(path) -> dict | None:
    """The record written beside checkpoint `path` (None: none, or unreadable)."""
    try:
        with open(f"{path}.json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def size_on_disk(path) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    return os.path.getsize(path) if os.path.exists(path) else 0


def _sha256(path, chunk=1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_records(path) -> dict:
    """{relative file name: {size, sha256}} of a checkpoint file or of every file in a folder."""
    if os.path.isfile(path):
        return {os.path.basename(path): {"size": os.path.getsize(path), "sha256": _sha256(path)}}
    return {name: {"size": os.path.getsize(os.path.join(path, name)), "sha256": _sha256(os.path.join(path, name))}
            for name in sorted(os.listdir(path))}


def verify_checkpoint(path: str, needs=(), weight_keys=ModelState.keys) -> dict:
    """Load `path` if its record, checksums and keys check out; raise ValueError saying why not
    (a file the disk cannot read is one such reason).

    Keys: the format's own, the record's, `needs` (the entries the parts that will load it
    cannot do without: CheckpointManager.needs) and, in a .pth, the model's `weight_keys`.
    Returns the state dict (for a DCP folder, only its trainer state: the shards are
    read later, straight into the model)."""
    record_path = f"{path}.json"
    if not os.path.exists(record_path):
        raise ValueError("no size/checksum record (its save was interrupted)")
    try:
        with open(record_path) as f:
            recorded = {name: {"size": e["size"], "sha256": e["sha256"]} for name, e in json.load(f)["files"].items()}
    except OSError as exc:
        raise ValueError(f"its record {os.path.basename(record_path)} cannot be read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not files -> {size, sha256}
        raise ValueError(f"unreadable record {os.path.basename(record_path)}") from None
    try:
        actual = file_records(path)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    for name, expected in recorded.items():
        if name not in actual:
            raise ValueError(f"{name} is missing")
        if actual[name]["size"] != expected["size"]:
            raise ValueError(f"{name} has {actual[name]['size']} bytes, but {expected['size']} were written "
                             f"(truncated?)")
        if actual[name]["sha256"] != expected["sha256"]:
            raise ValueError(f"{name}: sha256 does not match the one recorded at save time (corrupt)")
    state_file = os.path.join(path, TRAINER_STATE) if os.path.isdir(path) else path
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:
        raise ValueError(f"does not unpickle ({type(exc).__name__})") from None
    required = {"format", "model_config", *needs}
    if not os.path.isdir(path):
        required |= set(weight_keys)
    missing = required - set(state) if isinstance(state, dict) else required
    if missing or state.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint (missing {sorted(missing)})")
    return state
