"""Resume checkpoints that survive kills, full disks and corrupt files.

Layout in --checkpoint_dir, for the run prefix `{save_weight}_{hidden}[_moe]`:

    pretrain_512_resume_step0001200.pth        the checkpoint itself (torch.save)
    pretrain_512_resume_step0001200.pth.json   its size and sha256 (hashed as it was written), written after it
    pretrain_512_resume.pth -> ..._step0001200.pth   symlink to the newest, swapped atomically

FSDP runs write `..._step0001200.dcp/` instead (and point `..._resume.dcp` at it):
a torch.distributed.checkpoint folder (each rank writes its shard) plus
`trainer_state.pt`, with the same record beside it listing every file's size and sha256. Either kind loads into either
kind of run, at any world size.

A checkpoint becomes visible only through os.replace of a finished temp file or
folder, and the record comes after it, so a kill at any moment leaves every
earlier checkpoint intact and the half-written one unrecorded (and therefore skipped).

Only rank 0 writes a .pth and only rank 0 reads it back (and broadcasts it), so with
DDP the checkpoint directory may be a disk of node 0's own.
"""
import glob
import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict,
)

from common.atomic import atomic_torch_save, atomic_write_text
from common.errors import UserError
from trainer.distributed import Logger, barrier, broadcast_from_main, is_main_process

FORMAT = "minimind-resume-v1"
TRAINER_KEYS = {"format", "scaler", "global_step", "epoch", "step_in_epoch",
                "samples_per_step", "world_size", "model_config", "rng", "tokens_seen"}
WEIGHT_KEYS = {"model", "optimizer"}  # inside the .pth; a .dcp folder holds them as shards
TRAINER_STATE = "trainer_state.pt"
# Architecture fields a resumed run must agree on.
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size",
               "num_attention_heads", "num_key_value_heads", "intermediate_size")


def step_path(checkpoint_dir, prefix, global_step, sharded=False) -> str:
    suffix = "dcp" if sharded else "pth"
    return os.path.join(checkpoint_dir, f"{prefix}_resume_step{global_step:07d}.{suffix}")


def list_checkpoints(checkpoint_dir, prefix="*") -> list[str]:
    """Step checkpoints (files and DCP folders) of this run, newest first.

    Newest means most tokens trained, as recorded at save time: step numbers are not
    comparable across world sizes (a step of 2 processes is 2 steps of 1). Unrecorded
    ones (an interrupted save) sort last; they are skipped on load anyway.
    """
    pattern = os.path.join(glob.escape(checkpoint_dir), f"{prefix if prefix == '*' else glob.escape(prefix)}_resume_step*")
    paths = [p for p in glob.glob(pattern) if re.search(r"_resume_step\d+\.(pth|dcp)$", p)]
    return sorted(paths, key=_progress_of, reverse=True)


def _progress_of(path) -> tuple:
    step = int(re.search(r"_resume_step(\d+)\.", path).group(1))
    try:
        with open(f"{path}.json") as f:
            return (json.load(f)["tokens_seen"], step)
    except (OSError, ValueError, KeyError, TypeError):
        return (-1, step)


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


def _point_latest(checkpoint_dir, prefix, target):
    suffix = os.path.splitext(target)[1]  # .pth, or .dcp for a sharded folder
    link = os.path.join(checkpoint_dir, f"{prefix}_resume{suffix}")
    stale = os.path.join(checkpoint_dir, f"{prefix}_resume{'.pth' if suffix == '.dcp' else '.dcp'}")
    if os.path.islink(stale):  # the run switched between DDP and FSDP
        os.remove(stale)
    tmp = f"{link}.tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(target), tmp)
    os.replace(tmp, link)


def _file_records(path) -> dict:
    """{relative file name: {size, sha256}} of a checkpoint file or of every file in a folder."""
    if os.path.isfile(path):
        return {os.path.basename(path): {"size": os.path.getsize(path), "sha256": _sha256(path)}}
    return {name: {"size": os.path.getsize(os.path.join(path, name)), "sha256": _sha256(os.path.join(path, name))}
            for name in sorted(os.listdir(path))}


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _publish(path, checkpoint_dir, prefix, keep_last, trainer_state, files):
    """Rank 0, once `path` is complete: record it (`files`: {name: {size, sha256}}),
    point `latest` at it, drop the oldest."""
    record = {"global_step": trainer_state["global_step"], "tokens_seen": trainer_state["tokens_seen"],
              "world_size": trainer_state["world_size"], "files": files}
    atomic_write_text(f"{path}.json", json.dumps(record))
    _point_latest(checkpoint_dir, prefix, path)
    for old in list_checkpoints(checkpoint_dir, prefix)[max(1, keep_last):]:
        _remove(f"{old}.json")  # unrecord first: a kill in between leaves an ignored leftover
        _remove(old)


def save_checkpoint(trainer_state: dict, model, optimizer, checkpoint_dir: str, prefix: str,
                    keep_last: int = 3, sharded: bool = False) -> str:
    """Write a resume checkpoint; every rank must call this (it gathers and synchronises).

    `sharded`: the model is FSDP-sharded, so each rank writes its own shards (DCP);
    otherwise rank 0 writes one .pth with the full fp32 weights and optimizer state.
    """
    trainer_state = dict(trainer_state, format=FORMAT, rng=gather_rng_states())
    path = step_path(checkpoint_dir, prefix, trainer_state["global_step"], sharded)
    model_state, optim_state = get_state_dict(model, optimizer)
    if is_main_process():
        os.makedirs(checkpoint_dir, exist_ok=True)
        _remove(f"{path}.tmp")  # debris of a save that was killed
    if sharded:
        barrier()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=f"{path}.tmp")
        barrier()
        if is_main_process():
            torch.save(trainer_state, os.path.join(f"{path}.tmp", TRAINER_STATE))
            _remove(path)
            os.replace(f"{path}.tmp", path)
            # Every rank wrote shards through DCP's own writer: hash them by reading back.
            _publish(path, checkpoint_dir, prefix, keep_last, trainer_state, _file_records(path))
    elif is_main_process():
        written = atomic_torch_save(dict(trainer_state, model=model_state, optimizer=optim_state), path)
        _publish(path, checkpoint_dir, prefix, keep_last, trainer_state, {os.path.basename(path): written})
    barrier()
    return path


def restore_model_and_optimizer(state: dict, model, optimizer):
    """Load a checkpoint's weights and optimizer state into this run's (possibly sharded) model.

    A .pth is in rank 0's memory only (see load_latest_checkpoint): rank 0 broadcasts
    it tensor by tensor and every rank keeps its part, so no other rank reads the file,
    which may not even exist on its node."""
    if not state["path"].endswith(".dcp"):
        # Two calls, not set_state_dict: with an empty model state (every rank but 0) it
        # would skip the model on those ranks and leave rank 0 alone in the broadcast.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
        set_optimizer_state_dict(model, optimizer, state.pop("optimizer", {}), options=options)
        set_model_state_dict(model, state.pop("model", {}), options=options)
        return
    # A DCP folder: describe what this run holds, let DCP fill it from whatever sharding was saved.
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=state["path"])
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


# ---------------------------------------------------------------------------- loading
def _load_trainer_state(path) -> dict:
    state_file = os.path.join(path, TRAINER_STATE) if os.path.isdir(path) else path
    return torch.load(state_file, map_location="cpu", weights_only=True)


def verify_checkpoint(path: str) -> dict:
    """Load `path` if its record, checksums and keys check out; raise ValueError saying why not.

    Returns the state dict (for a DCP folder, only its trainer state: the shards are
    read later, straight into the model)."""
    record_path = f"{path}.json"
    if not os.path.exists(record_path):
        raise ValueError("no size/checksum record (its save was interrupted)")
    try:
        with open(record_path) as f:
            recorded = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"unreadable record {os.path.basename(record_path)}") from None
    actual = _file_records(path)
    for name, expected in recorded.items():
        if name not in actual:
            raise ValueError(f"{name} is missing")
        if actual[name]["size"] != expected["size"]:
            raise ValueError(f"{name} has {actual[name]['size']} bytes, but {expected['size']} were written (truncated?)")
        if actual[name]["sha256"] != expected["sha256"]:
            raise ValueError(f"{name}: sha256 does not match the one recorded at save time (corrupt)")
    try:
        state = _load_trainer_state(path)
    except Exception as exc:
        raise ValueError(f"does not unpickle ({type(exc).__name__})") from None
    required = TRAINER_KEYS | (set() if os.path.isdir(path) else WEIGHT_KEYS)
    missing = required - set(state) if isinstance(state, dict) else required
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
        for other in sorted(list_checkpoints(checkpoint_dir), key=os.path.getmtime, reverse=True):
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
    """The newest verified checkpoint, or None when this run has none.

    Only rank 0 looks at --checkpoint_dir and reads the checkpoint: on a cluster whose
    nodes each have their own disk, the file exists on rank 0's node alone. Every rank
    gets the trainer state (step, data position, every rank's RNG state; small) by
    broadcast; the weights and optimizer state of a .pth stay on rank 0 until
    restore_model_and_optimizer broadcasts them."""
    trainer_state, message = None, None
    if is_main_process():
        try:
            path, state = _choose_checkpoint(checkpoint_dir, prefix, model_config)
        except UserError as exc:
            path, state, message = None, None, str(exc)
        if path is not None:
            trainer_state = {k: v for k, v in state.items() if k not in WEIGHT_KEYS} | {"path": path}
    trainer_state, message = broadcast_from_main((trainer_state, message))
    if message:
        raise UserError(message)
    if trainer_state is None:
        return None
    if is_main_process() and not trainer_state["path"].endswith(".dcp"):
        return dict(trainer_state, **{k: state[k] for k in WEIGHT_KEYS})
    return trainer_state


def lm_checkpoint(checkpoint_dir, prefix, model=None, optimizer=None, state=None, model_config=None,
                  keep_last=3, sharded=False):
    """MiniMind-style single entry point: save when `state` is given, else load the latest."""
    if state is not None:
        return save_checkpoint(state, model, optimizer, checkpoint_dir, prefix, keep_last, sharded)
    return load_latest_checkpoint(checkpoint_dir, prefix, model_config or {})
