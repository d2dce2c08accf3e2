"""Resume checkpoints that survive kills, full disks and corrupt files: how a checkpoint is
written, rotated and chosen (its name, the order of the checkpoints and its verification are
trainer/checkpoint_files.py's). What goes into one is each part's own (trainer/train_state.py:
every stateful part saves, loads and names its entries itself).

A checkpoint is one dict: {"format": FORMAT, "model_config": ...} plus what each part of the run
adds ("model", "optimizer", "scaler", "rng", and the TrainState's "global_step", "tokens_seen",
"world_size", the data position, ...). Layout in --checkpoint_dir, for the run prefix
`{save_weight}_{hidden}[_moe]`:

    pretrain_768_resume_step0001200.pth        the checkpoint itself (torch.save of the dict)
    pretrain_768_resume_step0001200.pth.json   its record: step, tokens trained, world size, the run's
                                               resolved config, and each file's size and sha256
    pretrain_768_resume.pth -> ..._step0001200.pth   symlink to the newest, swapped atomically
    pretrain_768_resume_step0001200_2.pth      a later save at a step of the same number (a resume on
                                               another world size renumbers the steps; a redone step):
                                               it replaces the first only once it is whole

FSDP runs write `..._step0001200.dcp/` instead (and point `..._resume.dcp` at it): a
torch.distributed.checkpoint folder of the model's and optimizer's shards (each rank writes
its own) plus `trainer_state.pt` with the rest. Either kind loads into either kind of run.

A save writes the checkpoint under a temp name (`...pth.tmp`, `...dcp.tmp/`), then the inference
weights, then the record, and only then renames the checkpoint into place: a checkpoint is
visible once it and its record are whole, so a kill at any moment leaves the earlier state or
the new one (tests/resume/test_checkpoint_safety.py kills a save at each of its steps). A save that fails (a full disk, EIO) removes what
it wrote, leaves the earlier checkpoints and the link as they were, and stops every rank with
the same one line. At start-up rank 0 removes what a killed save left behind and warns when
the disk cannot hold --keep_last more checkpoints. Newest means the latest run's (a fresh
run in a folder holding an earlier run's checkpoints comes first), then most tokens trained: step
numbers are not comparable across world sizes.

Only rank 0 writes a .pth and only rank 0 reads it back (and broadcasts it), so with DDP the
checkpoint directory may be a disk of node 0's own.
"""
import glob
import json
import os
import re

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from common.errors import StorageError, UserError, free_bytes, os_error_of, size_text, storage_error
from common.storage import atomic_torch_save, atomic_write_text, remove_quietly
from model.model_minimind import SHAPE_FIELDS
from trainer.checkpoint_files import (
    FORMAT, STEP_NAME, TRAINER_STATE, file_records, latest_path, list_checkpoints, orphan_records, other_shapes,
    record_of, run_number, size_on_disk, step_path, verify_checkpoint,
)
from trainer.config import LAUNCH_GROUPS
from trainer.distributed import TORCH_COLLECTIVES, Logger

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
        if not finite:  # every rank alike: the job stops with this line (said once per node: fail())
            raise UserError(f"the model's weights at step {global_step} are not finite (inf or NaN), so no "
                            f"checkpoint is saved and the earlier ones are kept: resume from the newest with "
                            f"--from_resume 1 and a lower --learning_rate (or --muon_lr)")
        weights = None
        if self.weights_path:  # the same on every rank: a gather under FSDP
            weights = self.model_state.full_weights()
        state = {"format": FORMAT, "model_config": self.model_config}
        for part in self.parts.values():
            entries = part.state_dict()
            if set(entries) & set(state):
                raise ValueError(f"checkpoint parts both write {sorted(set(entries) & set(state))}")
            state.update(entries)
        path = self.collectives.broadcast(self._free_path(global_step) if self.collectives.rank == 0 else None)
        shards = self.model_state.state_dict()
        problem = None
        if self.sharded:  # the same on every rank: each writes its shards (DCP's save, a collective)
            problem = self._write_shards(path, shards)
        if problem is None and self.collectives.rank == 0:
            problem = self._write(path, state, None if self.sharded else shards, weights)
        problem = self.collectives.agree(problem)  # every rank stops, or goes on, together
        if problem:
            raise StorageError(problem)
        return path

    def _free_path(self, global_step: int) -> str:
        """Rank 0's name for a save at `global_step`: step_path, or, where checkpoints (or records)
        of that step number are already here, the copy numbered after the last of them. A resume on
        another world size re-expresses the step (1 process's step 200 resumes as 2 processes'
        step 100, whose next save is step 200 again), and a save never touches the checkpoints
        before it: the rotation replaces them once the new one is whole."""
        first = step_path(self.folder, self.prefix, global_step, self.sharded)
        names = glob.glob(f"{glob.escape(os.path.splitext(first)[0])}*")
        found = [re.search(STEP_NAME, name.removesuffix(".json")) for name in names]
        copies = [int(m.group(2) or 1) for m in found if m and int(m.group(1)) == global_step]
        return step_path(self.folder, self.prefix, global_step, self.sharded, max(copies, default=0) + 1)

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
            if weights_state is None:  # a .dcp folder: its shards are in place
                atomic_torch_save(state, os.path.join(staged, TRAINER_STATE), "the checkpoint",
                                  **AFTER_A_FAILED_SAVE)
                files = file_records(staged)  # every rank wrote shards through DCP's own writer
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
        self._rotate(path)
        return None

    def _rotate(self, path: str):
        """Once `path` is whole: remove the checkpoints it takes the place of (earlier saves at a
        step of the same number), then all but `path` and the --keep_last - 1 newest behind it.
        One that sorts ahead of `path` holds more progress: a resume skipped it as unusable, so it
        is neither counted nor removed (it would otherwise leave `path` itself to the rotation)."""
        step, copy = re.search(STEP_NAME, path).group(1, 2)
        replaced = [step_path(self.folder, self.prefix, int(step), self.sharded, c) for c in range(1, int(copy or 1))]
        ordered = list_checkpoints(self.folder, self.prefix)
        behind = ordered[ordered.index(path) + 1:] if path in ordered else []
        for old in replaced + behind[max(0, self.keep_last - 1):]:
            remove_quietly(f"{old}.json")  # unrecord first: a kill in between leaves an ignored leftover
            remove_quietly(old)

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
        held = sum(size_on_disk(p) for p in list_checkpoints(self.folder, self.prefix))
        free, needed = free_bytes(self.folder), (self.keep_last + 1) * estimated_bytes
        if free is not None and free + held < needed:
            Logger(f"warning: --checkpoint_dir {self.folder} has {size_text(free)} free (and {size_text(held)} in "
                   f"this run's checkpoints), but --keep_last {self.keep_last} needs about {size_text(needed)} "
                   f"({self.keep_last + 1} x {size_text(estimated_bytes)}: those kept and the one being written); "
                   f"a save that does not fit stops the run: free space, lower --keep_last or pass another "
                   f"--checkpoint_dir")

    def next_run_number(self) -> int:
        """A fresh run's number: one more than that of the newest checkpoint of this prefix here (0
        for one saved before runs were numbered), so its checkpoints, not an earlier run's, are
        the newest to the rotation and to a later resume, as a fresh MiniMind run overwrites its
        resume file. Rank 0 reads the records and says what it found; every rank gets the number."""
        number = None
        if self.collectives.rank == 0:
            records = [r for r in map(record_of, list_checkpoints(self.folder, self.prefix)) if r is not None]
            number = 1 + max((run_number(r) for r in records), default=0)
            if records:
                Logger(f"--checkpoint_dir {self.folder} holds {len(records)} checkpoints of an earlier run of "
                       f"{self.prefix} (the newest at step {records[0].get('global_step')}): this run's saves come "
                       f"first, and --keep_last {self.keep_last} removes them as it saves (to continue that run "
                       f"instead, relaunch with --from_resume 1)")
        return self.collectives.broadcast(number)

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
            # The same --save_weight at another shape (say, another --hidden_size) with a usable
            # checkpoint means the flags changed, not that this is a new run: say so instead of
            # silently starting over. Another --save_weight names another run: not a reason to stop.
            for other in sorted(other_shapes(self.folder, self.prefix), key=os.path.getmtime, reverse=True):
                try:
                    saved_config = verify_checkpoint(other, self.needs, self.model_state.keys)["model_config"]
                except ValueError:
                    continue
                check_config_matches(other, saved_config, self.model_config)
            return None, None
        # The record newest_record() gave the run its config from: the first readable one.
        configured_by = next((p for p in candidates if record_of(p) is not None), None)
        for path in candidates:
            try:
                state = verify_checkpoint(path, self.needs, self.model_state.keys)
            except ValueError as exc:
                Logger(f"skipping checkpoint {path}: {exc}")
                continue
            check_config_matches(path, state["model_config"], self.model_config)
            if path != configured_by and _run_config(path) != _run_config(configured_by):
                raise UserError(f"checkpoint {configured_by} is skipped (above), but this run took its config from "
                                f"its record, and {path}, the newest usable, was saved with another: move "
                                f"{configured_by} aside and resume again")
            return path, state
        raise UserError(f"--from_resume 1: none of the {len(candidates)} checkpoints in {self.folder} is usable "
                        f"(see above); move them aside to start fresh")


def newest_record(folder: str, prefix: str, collectives=TORCH_COLLECTIVES) -> dict:
    """The record beside the newest checkpoint of `prefix`, with its "path" ({} when there is
    none): what a resume must know before the model and optimizer exist, the run's stored config
    above all. Rank 0 reads it and every rank gets it (a collective)."""
    record = {}
    if collectives.rank == 0:
        records = ((path, record_of(path)) for path in list_checkpoints(folder, prefix))
        record = next(({**r, "path": path} for path, r in records if r is not None), {})
    return collectives.broadcast(record)


def _run_config(path) -> dict:
    """The groups of the config stored in a checkpoint's record that a resume takes (not the launch's)."""
    stored = (record_of(path) or {}).get("config")
    return {g: v for g, v in stored.items() if g not in LAUNCH_GROUPS} if isinstance(stored, dict) else {}


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


def check_config_matches(path: str, saved: dict, current: dict):
    for key in SHAPE_FIELDS:
        if saved.get(key) != current.get(key):
            raise UserError(
                f"checkpoint {path} was saved with {key}={saved.get(key)}, but the flags give "
                f"{key}={current.get(key)}; "
                f"rerun with the flags it was trained with, or point --checkpoint_dir elsewhere to start fresh"
            )
