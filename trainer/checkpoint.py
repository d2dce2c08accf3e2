"""Resume checkpoints that survive kills, full disks and corrupt files: how a checkpoint is
written, verified and chosen, and where it lies. What goes into one is each part's own
(trainer/train_state.py: every stateful part saves, loads and names its entries itself).

A checkpoint is one dict: {"format": FORMAT, "model_config": ...} plus what each part of the run
adds ("model", "optimizer", "scaler", "rng", and the TrainState's "global_step", "tokens_seen",
"world_size", the data position, ...). Layout in --checkpoint_dir, for the run prefix
`{save_weight}_{hidden}[_moe]`:

    pretrain_768_resume_step0001200.pth        the checkpoint itself (torch.save of the dict)
    pretrain_768_resume_step0001200.pth.json   its record: step, tokens trained, world size, the run's
                                               resolved config, and each file's size and sha256
    pretrain_768_resume.pth -> ..._step0001200.pth   symlink to the newest, swapped atomically

FSDP runs write `..._step0001200.dcp/` instead (and point `..._resume.dcp` at it): a
torch.distributed.checkpoint folder of the model's and optimizer's shards (each rank writes
its own) plus `trainer_state.pt` with the rest. Either kind loads into either kind of run.

A save writes the checkpoint under a temp name (`...pth.tmp`, `...dcp.tmp/`), then the inference
weights, then the record, and only then renames the checkpoint into place: a checkpoint is
visible once it and its record are whole, so a kill at any moment leaves the earlier state or
the new one (tests/resume/test_checkpoint_safety.py kills a save at each of its steps). A save that fails (a full disk, EIO) removes what
it wrote, leaves the earlier checkpoints and the link as they were, and stops every rank with
the same one line. At start-up rank 0 removes what a killed save left behind and warns when
the disk cannot hold --keep_last more checkpoints. Newest means most tokens trained: step
numbers are not comparable across world sizes.

Only rank 0 writes a .pth and only rank 0 reads it back (and broadcasts it), so with DDP the
checkpoint directory may be a disk of node 0's own.
"""
import glob
import hashlib
import json
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from common.errors import StorageError, UserError, free_bytes, os_error_of, size_text, storage_error
from common.storage import atomic_torch_save, atomic_write_text, remove_quietly
from model.model_minimind import SHAPE_FIELDS
from trainer.distributed import TORCH_COLLECTIVES, Logger
from trainer.train_state import ModelState

FORMAT = "minimind-resume-v1"
TRAINER_STATE = "trainer_state.pt"
# What a failed save's line says to do, besides freeing space.
AFTER_A_FAILED_SAVE = dict(elsewhere="lower --keep_last or pass another --checkpoint_dir",
                           then=", then relaunch with --from_resume 1: the checkpoints before this one are intact")


class CheckpointManager:
    """Saves and resumes one run's checkpoints in `folder`, from and into its parts.

    model_state: trainer/train_state.py's ModelState (the weights and optimizer state; under
    `sharded` every rank writes its shards); parts: the other parts, in load order. A checkpoint
    lacking an entry that the model state or a part names in its `keys` is skipped, like a damaged
    one; the entries a part names in its `record_keys` are written in the record too.
    weights_path: where each save also writes the half-precision inference weights (None: not).
    config: the run's resolved config, written in every record. Every rank calls save() and
    resume() with the same arguments: both are collectives.
    """

    def __init__(self, folder: str, prefix: str, model_config: dict, model_state, parts: dict, keep_last: int = 3,
                 sharded: bool = False, weights_path: str | None = None, collectives=TORCH_COLLECTIVES,
                 config: dict | None = None):
        self.folder, self.prefix, self.model_config = folder, prefix, model_config
        self.model_state, self.parts, self.keep_last, self.sharded = model_state, parts, keep_last, sharded
        self.weights_path, self.collectives, self.config = weights_path, collectives, config
        self.needs = tuple(key for part in parts.values() for key in part.keys)
        self.record_keys = tuple(key for part in parts.values() for key in getattr(part, "record_keys", ()))

    # ------------------------------------------------------------------ saving
    def save(self, global_step: int) -> str:
        """The inference weights and a resume checkpoint at `global_step`; returns its path."""
        # A checkpoint of NaNs would push a good one out of the rotation: refuse to write it.
        finite = self.model_state.finite()  # a collective: a statement of its own, reached by every rank
        if not finite:
            raise RuntimeError("model weights are not finite; refusing to save a checkpoint")
        weights = self.model_state.full_weights() if self.weights_path else None  # every rank: a gather under FSDP
        state = {"format": FORMAT, "model_config": self.model_config}
        for part in self.parts.values():
            entries = part.state_dict()
            if set(entries) & set(state):
                raise ValueError(f"checkpoint parts both write {sorted(set(entries) & set(state))}")
            state.update(entries)
        path = step_path(self.folder, self.prefix, global_step, self.sharded)
        shards = self.model_state.state_dict()
        problem = self._write_shards(path, shards) if self.sharded else None
        if problem is None and self.collectives.rank == 0:
            problem = self._write(path, state, None if self.sharded else shards, weights)
        problem = self.collectives.agree(problem)  # every rank stops, or goes on, together
        if problem:
            raise StorageError(problem)
        return path

    def _write_shards(self, path: str, shards: dict) -> str | None:
        """Every rank writes its shards into `path`.tmp (DCP tells every rank if any failed)."""
        if self.collectives.rank == 0:
            remove_quietly(f"{path}.tmp")  # debris of a save that was killed
        self.collectives.barrier()
        try:
            dcp.save(shards, checkpoint_id=f"{path}.tmp")
            return None
        except CheckpointException as exc:
            if self.collectives.rank == 0:
                remove_quietly(f"{path}.tmp")
            causes = [os_error_of(e) for e, _ in exc.failures.values()]
            cause = next((c for c in causes if c is not None and c.errno), None) or next(filter(None, causes), None)
            if cause is None:
                raise
            needed = getattr(self.model_state, "estimated_bytes", lambda: None)()
            return str(storage_error(cause, "the checkpoint's shards", f"{path}.tmp", needed, **AFTER_A_FAILED_SAVE))

    def _write(self, path: str, state: dict, weights_state: dict | None, weights: dict | None) -> str | None:
        """Rank 0, in this order: the checkpoint under its temp name (a .pth, or the rest of a .dcp
        folder), the inference weights, the record, the checkpoint renamed into place, the link,
        the rotation. On a failed write, what it wrote is removed again and the one line returned."""
        staged = f"{path}.tmp"
        try:
            os.makedirs(self.folder, exist_ok=True)
            remove_quietly(f"{path}.json")  # the same step saved before (a resume redoing it): unrecord it first
            remove_quietly(path)
            if weights_state is None:  # a .dcp folder: its shards are in place
                atomic_torch_save(state, os.path.join(staged, TRAINER_STATE), "the checkpoint",
                                  **AFTER_A_FAILED_SAVE)
                files = _file_records(staged)  # every rank wrote shards through DCP's own writer
            else:
                written = atomic_torch_save(dict(state, **weights_state), path, "the checkpoint", publish=False,
                                            **AFTER_A_FAILED_SAVE)  # at `staged` until its record is written
                files = {os.path.basename(path): written}
            if weights is not None:
                self.model_state.write_weights(weights, self.weights_path)
            record = {k: state[k] for k in self.record_keys}
            atomic_write_text(f"{path}.json", json.dumps({**record, "config": self.config, "files": files}),
                              "the checkpoint's record", **AFTER_A_FAILED_SAVE)
            os.replace(staged, path)  # visible now, and whole: its record is in place
            _point_latest(self.folder, self.prefix, path)
        except (StorageError, OSError) as exc:
            remove_quietly(f"{path}.json")
            remove_quietly(path)
            remove_quietly(f"{path}.tmp")
            if isinstance(exc, StorageError):
                return str(exc)
            return str(storage_error(exc, "the checkpoint", path, **AFTER_A_FAILED_SAVE))
        for old in list_checkpoints(self.folder, self.prefix)[max(1, self.keep_last):]:
            remove_quietly(f"{old}.json")  # unrecord first: a kill in between leaves an ignored leftover
            remove_quietly(old)
        return None

    # ------------------------------------------------------------------ start-up
    def tidy(self, estimated_bytes: int):
        """Rank 0, who owns the disk: remove what a killed save of this run left behind, and warn
        when the disk cannot hold --keep_last checkpoints of `estimated_bytes` (one more is
        written before the oldest goes)."""
        if self.collectives.rank != 0:
            return
        leftovers = glob.glob(os.path.join(glob.escape(self.folder), f"{glob.escape(self.prefix)}_resume*.tmp"))
        leftovers += orphan_records(self.folder, self.prefix)
        if self.weights_path:
            leftovers += [p for p in (f"{self.weights_path}.tmp", f"{os.path.splitext(self.weights_path)[0]}.json.tmp")
                          if os.path.lexists(p)]
        for path in leftovers:
            remove_quietly(path)
            Logger(f"removed {path}, left by a save that did not finish")
        held = sum(_size_on_disk(p) for p in list_checkpoints(self.folder, self.prefix))
        free, needed = free_bytes(self.folder), (self.keep_last + 1) * estimated_bytes
        if free is not None and free + held < needed:
            Logger(f"warning: --checkpoint_dir {self.folder} has {size_text(free)} free (and {size_text(held)} in "
                   f"this run's checkpoints), but --keep_last {self.keep_last} needs about {size_text(needed)} "
                   f"({self.keep_last + 1} x {size_text(estimated_bytes)}: those kept and the one being written); "
                   f"a save that does not fit stops the run: free space, lower --keep_last or pass another "
                   f"--checkpoint_dir")

    # ------------------------------------------------------------------ resuming
    def resume(self) -> dict | None:
        """Load the newest usable checkpoint into the model and every part; returns what was
        saved besides the weights (its "path" included), or None when there is none."""
        saved = self.latest()
        if saved is None:
            return None
        try:
            self.model_state.load_state_dict(saved)
        except KeyError as missing:
            raise UserError(f"checkpoint {saved['path']}: its optimizer state has no {missing} for this run's "
                            f"optimizer; resume with the --optimizer and --param_groups it was trained with") from None
        try:
            for part in self.parts.values():
                part.load_state_dict(saved)
        except KeyError as missing:
            raise UserError(f"checkpoint {saved['path']} has no {missing} entry: it was written by another version "
                            f"of this trainer; resume with that version, or move it aside to start fresh") from None
        return {k: v for k, v in saved.items() if k not in self.model_state.keys}

    def latest(self) -> dict | None:
        """The newest verified checkpoint, or None when this run has none.

        Only rank 0 looks at the folder and reads the checkpoint: on a cluster whose nodes
        each have their own disk, the file exists on rank 0's node alone. Every rank gets
        the rest (step, data position, every rank's RNG state; small) by broadcast; the
        weights and optimizer state of a .pth stay on rank 0 until ModelState.load_state_dict
        broadcasts them."""
        rest, message, state = None, None, None
        if self.collectives.rank == 0:
            try:
                path, state = self._choose()
            except UserError as exc:
                path, message = None, str(exc)
            if path is not None:
                rest = {k: v for k, v in state.items() if k not in self.model_state.keys} | {"path": path}
        rest, message = self.collectives.broadcast((rest, message))
        if message:
            raise UserError(message)
        if rest is None:
            return None
        if self.collectives.rank == 0 and not rest["path"].endswith(".dcp"):
            return dict(rest, **{k: state[k] for k in self.model_state.keys})
        return rest

    def _choose(self):
        """Rank 0's pick: (path, state) to resume, (None, None) to start fresh; raises UserError to stop."""
        candidates = list_checkpoints(self.folder, self.prefix)
        if not candidates:
            # Another prefix (say, a different --hidden_size) with a usable checkpoint means the
            # flags changed, not that this is a new run: say so instead of silently starting over.
            for other in sorted(list_checkpoints(self.folder), key=os.path.getmtime, reverse=True):
                try:
                    saved_config = verify_checkpoint(other, self.needs, self.model_state.keys)["model_config"]
                except ValueError:
                    continue
                check_config_matches(other, saved_config, self.model_config)
            return None, None
        for path in candidates:
            try:
                state = verify_checkpoint(path, self.needs, self.model_state.keys)
            except ValueError as exc:
                Logger(f"skipping checkpoint {path}: {exc}")
                continue
            check_config_matches(path, state["model_config"], self.model_config)
            return path, state
        raise UserError(f"--from_resume 1: none of the {len(candidates)} checkpoints in {self.folder} is usable "
                        f"(see above); move them aside to start fresh")


def newest_record(folder: str, prefix: str, collectives=TORCH_COLLECTIVES) -> dict:
    """The record beside the newest checkpoint of `prefix`, with its "path" ({} when there is
    none): what a resume must know before the model and optimizer exist, the run's stored config
    above all. Rank 0 reads it and every rank gets it (a collective)."""
    record = {}
    if collectives.rank == 0:
        records = ((path, _record_of(path)) for path in list_checkpoints(folder, prefix))
        record = next(({**r, "path": path} for path, r in records if r is not None), {})
    return collectives.broadcast(record)


# ---------------------------------------------------------------------------- the files
def step_path(checkpoint_dir, prefix, global_step, sharded=False) -> str:
    return os.path.join(checkpoint_dir, f"{prefix}_resume_step{global_step:07d}{_extension(sharded)}")


def latest_path(checkpoint_dir, prefix, sharded=False) -> str:
    """The link to the newest checkpoint, for people and scripts (a resume picks by the records)."""
    return os.path.join(checkpoint_dir, f"{prefix}_resume{_extension(sharded)}")


def _extension(sharded: bool) -> str:
    return ".dcp" if sharded else ".pth"  # a torch.distributed.checkpoint folder, or one torch.save file


def list_checkpoints(checkpoint_dir, prefix="*") -> list[str]:
    """Step checkpoints (files and DCP folders) of this run, newest first: most tokens trained,
    as recorded at save time (a step of 2 processes is 2 steps of 1). Unrecorded ones (an
    interrupted save) sort last; they are skipped on load anyway."""
    name = prefix if prefix == "*" else glob.escape(prefix)
    pattern = os.path.join(glob.escape(checkpoint_dir), f"{name}_resume_step*")
    paths = [p for p in glob.glob(pattern) if re.search(r"_resume_step\d+\.(pth|dcp)$", p)]
    return sorted(paths, key=_progress_of, reverse=True)


def orphan_records(checkpoint_dir, prefix) -> list[str]:
    """Records whose checkpoint is not there: a save killed between its record and its rename."""
    pattern = os.path.join(glob.escape(checkpoint_dir), f"{glob.escape(prefix)}_resume_step*.json")
    return [p for p in glob.glob(pattern) if re.search(r"\.(pth|dcp)\.json$", p) and not os.path.lexists(p[:-5])]


def _progress_of(path) -> tuple:
    step = int(re.search(r"_resume_step(\d+)\.", path).group(1))
    tokens = (_record_of(path) or {}).get("tokens_seen")
    return (tokens if isinstance(tokens, int) else -1, step)


def _record_of(path) -> dict | None:
    """The record written beside checkpoint `path` (None: none, or unreadable)."""
    try:
        with open(f"{path}.json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _size_on_disk(path) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    return os.path.getsize(path) if os.path.exists(path) else 0


def _sha256(path, chunk=1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _point_latest(checkpoint_dir, prefix, target):
    sharded = target.endswith(".dcp")
    link = latest_path(checkpoint_dir, prefix, sharded)
    stale = latest_path(checkpoint_dir, prefix, not sharded)
    try:
        if os.path.islink(stale):  # the run switched between DDP and FSDP
            os.remove(stale)
        remove_quietly(f"{link}.tmp")
        os.symlink(os.path.basename(target), f"{link}.tmp")
        os.replace(f"{link}.tmp", link)
    except OSError as exc:
        remove_quietly(f"{link}.tmp")
        raise storage_error(exc, "the link", link, **AFTER_A_FAILED_SAVE) from None


def _file_records(path) -> dict:
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
            recorded = json.load(f)["files"]
    except OSError as exc:
        raise ValueError(f"its record {os.path.basename(record_path)} cannot be read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"unreadable record {os.path.basename(record_path)}") from None
    try:
        actual = _file_records(path)
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


def check_config_matches(path: str, saved: dict, current: dict):
    for key in SHAPE_FIELDS:
        if saved.get(key) != current.get(key):
            raise UserError(
                f"checkpoint {path} was saved with {key}={saved.get(key)}, but the flags give "
                f"{key}={current.get(key)}; "
                f"rerun with the flags it was trained with, or point --checkpoint_dir elsewhere to start fresh"
            )
