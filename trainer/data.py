"""Datasets, the resumable sampler and the loaders of the training stages (trainer/loop.py),
and the global batches of every optimizer step.

trainer/train_state.py says why every run, one process or many, reads its samples
through a DistributedSampler, and where in the data each optimizer step starts.
"""
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset

from common.errors import UserError
from dataset.lm_dataset import NextTokenTargets, PretrainDataset
from dataset.packed_dataset import PackedPretrainDataset
from dataset.sft_dataset import ChatOptions, PackedSFTDataset, SFTDataset
from dataset.shards import MANIFEST, PREP_DIR, ShardedPackedDataset
from dataset.sources import GLOB_CHARS, resolve_data_paths
from trainer.distributed import Logger


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into its epoch."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = 0

    def set_start(self, start: int):
        self.start = start

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return self.num_samples - self.start


@dataclass(frozen=True)
class TrainData:
    """Training and validation samples, each (input ids, next-token targets) whatever the files
    (and, where the data marks them, where its documents start: trainer/step.py's attention_mask)."""
    train: Dataset
    val: Dataset | None
    packed: bool  # a sample may hold several documents (packed windows), not one padded one


def open_dataset(path: str, flag: str, tokenizer, max_seq_len: int, vocab_size: int):
    """One .jsonl or .bin file; or a manifest, directory or glob of .bin shards (one packed
    stream) or of .jsonl files (their lines one after the other). Samples are (input ids,
    next-token targets) in both kinds."""
    as_path = Path(path)
    one_file = as_path.is_file() or not (as_path.is_dir() or any(c in path for c in GLOB_CHARS))
    if one_file and as_path.name != MANIFEST:  # a missing file gets the message of its kind
        if as_path.suffix == ".bin":
            return PackedPretrainDataset(path, max_seq_len, vocab_size=vocab_size, tokenizer=tokenizer)
        if as_path.suffix in (".jsonl", ".json"):
            return NextTokenTargets(PretrainDataset(path, tokenizer, max_seq_len))
    if as_path.is_file() and as_path.name != MANIFEST:
        raise UserError(f"{flag} {path}: expected a .jsonl file, or .bin shards made by scripts/prepare_data.py "
                        f"(a file, a directory or a quoted glob)")
    if as_path.is_file() or (as_path / MANIFEST).is_file() or (as_path / PREP_DIR).is_dir():
        return ShardedPackedDataset(path, max_seq_len, vocab_size=vocab_size, tokenizer=tokenizer)
    files = resolve_data_paths(path, (".bin", ".jsonl", ".parquet"), flag)
    kinds = {f.suffix for f in files}
    if ".parquet" in kinds:
        raise UserError(f"{flag} {path}: Parquet is read by scripts/prepare_data.py, not the trainer: run it with "
                        f"--data_path '{path}' --out_path <dir>, then train with --data_path <dir>")
    if kinds == {".bin"}:
        return ShardedPackedDataset(path, max_seq_len, vocab_size=vocab_size, tokenizer=tokenizer)
    if kinds == {".jsonl"}:
        return NextTokenTargets(ConcatDataset([PretrainDataset(f, tokenizer, max_seq_len) for f in files]))
    raise UserError(f"{flag} {path}: holds both .bin and .jsonl files; pass one kind")


def build_data(cfg, tokenizer, vocab_size: int) -> TrainData:
    """Pre-training's samples: --data_path, and --val_data_path or the tail of --data_path."""
    data, seq_len = cfg.data, cfg.model.max_seq_len
    full = open_dataset(data.data_path, "--data_path", tokenizer, seq_len, vocab_size)
    packed = not isinstance(full, NextTokenTargets)
    if data.val_data_path:
        # Either kind validates either kind of run: runs on padded and on packed data can
        # then be compared on one validation set (scripts/bench/bench_quality.py does).
        return TrainData(full, open_dataset(data.val_data_path, "--val_data_path", tokenizer, seq_len, vocab_size),
                         packed)
    return split_tail(full, data.val_fraction, packed)


def open_conversations(path: str, flag: str, tokenizer, max_seq_len: int, vocab_size: int, options: ChatOptions):
    """A .jsonl of conversations (MiniMind's, padded) or a .bin of them (prepare_data.py --sft, packed)."""
    suffix = Path(path).suffix
    if suffix == ".bin":
        return PackedSFTDataset(path, max_seq_len, vocab_size=vocab_size, tokenizer=tokenizer,
                                pad_id=tokenizer.pad_token_id)
    if suffix in (".jsonl", ".json"):
        return SFTDataset(path, tokenizer, max_seq_len, options, flag)
    raise UserError(f"{flag} {path}: fine-tuning reads a .jsonl of conversations, or the .bin that "
                    f"scripts/prepare_data.py --sft makes of one")


def build_sft_data(cfg, tokenizer, vocab_size: int) -> TrainData:
    """Fine-tuning's samples: conversations from --data_path, and --val_data_path or the tail."""
    data, seq_len = cfg.data, cfg.model.max_seq_len
    options = ChatOptions(cfg.chat.add_system_ratio, cfg.chat.empty_think_ratio, cfg.optim.seed)
    full = open_conversations(data.data_path, "--data_path", tokenizer, seq_len, vocab_size, options)
    packed = isinstance(full, PackedSFTDataset)
    val = None
    if data.val_data_path:
        val = open_conversations(data.val_data_path, "--val_data_path", tokenizer, seq_len, vocab_size,
                                 ChatOptions())  # held-out text as it is
    for name, dataset in (("--data_path", full), ("--val_data_path", val)):
        if dataset is not None and dataset.skipped:
            Logger(f"{name}: {dataset.skipped:,} conversations skipped: none of their complete turns within "
                   f"--max_seq_len {seq_len} tokens holds an assistant reply")
    return TrainData(full, val, packed) if val is not None else split_tail(full, data.val_fraction, packed)


def split_tail(full: Dataset, val_fraction: float, packed: bool) -> TrainData:
    """The tail of `full` held out, so the split is the same on every rank and every run."""
    n_val = int(len(full) * val_fraction)
    if n_val == 0:
        return TrainData(full, None, packed)
    n_train = len(full) - n_val
    return TrainData(Subset(full, range(n_train)), Subset(full, range(n_train, len(full))), packed)


def make_train_loader(dataset, sampler, batch_size: int, num_workers: int, dist_timeout: float,
                      pin_memory: bool) -> DataLoader:
    # A worker that stops delivering (its process alive, the thread that sends batches
    # dead) would leave the trainer waiting forever: past --dist_timeout the rank fails
    # instead, as it does when a peer stops answering in a collective.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, timeout=dist_timeout if num_workers > 0 else 0,
                      drop_last=False)


class LoaderStalled(RuntimeError):
    """This rank's DataLoader stopped delivering: one line, said by this rank (the others only
    see a lost peer)."""


def delivered_batches(loader, dist_timeout: float, rank: int):
    """The loader's batches, with its two failures of a worker process each turned into one line."""
    try:
        yield from loader  # iter(loader) too waits for workers (persistent ones are resumed)
    except RuntimeError as exc:
        if "DataLoader timed out" in str(exc):
            raise LoaderStalled(
                f"rank {rank}: no batch from its DataLoader worker within --dist_timeout {dist_timeout:g} s "
                f"(a worker that hangs, or waits on a slow file system): check the data's disk and the "
                f"workers' memory, raise --dist_timeout, or pass --num_workers 0") from None
        if "exited unexpectedly" in str(exc):
            raise LoaderStalled(
                f"rank {rank}: a DataLoader worker died ({str(exc).splitlines()[0][:120]}): often the kernel's "
                f"out-of-memory killer; check `dmesg`, lower --num_workers or --batch_size") from None
        raise


def make_val_loader(val_set, batch_size: int, eval_batches: int, rank: int, world_size: int,
                    pin_memory: bool) -> DataLoader:
    """A fixed slice of the validation set, strided over ranks without padding, so no
    sample is counted twice; every rank gets as many batches (FSDP needs all of them in
    each forward)."""
    n = min(len(val_set), eval_batches * batch_size * world_size) // world_size * world_size
    if n == 0:  # the same on every rank, before any collective
        raise UserError(f"the validation set holds {len(val_set)} samples, fewer than the {world_size} processes, and "
                        f"each process scores whole samples: hold out more (--val_fraction, --val_data_path), or "
                        f"pass --val_fraction 0 without --val_data_path to train without validation")
    return DataLoader(Subset(val_set, range(rank, n, world_size)), batch_size=batch_size,
                      num_workers=0, pin_memory=pin_memory)


def global_batches(loader, sampler, plan, start_step: int, dist_timeout: float, rank: int):
    """(epoch, micro-batches) of every optimizer step from `start_step` on, epoch after epoch:
    each epoch's loader starts where that step's samples start (trainer/train_state.py)."""
    step = start_step
    while True:
        where = plan.position(step)
        sampler.set_epoch(where.epoch)
        sampler.set_start(where.sampler_start)
        batches = delivered_batches(loader, dist_timeout, rank)
        for _ in range(plan.steps_per_epoch - where.step_in_epoch):
            yield where.epoch, [next(batches) for _ in range(plan.accumulation_steps)]
            step += 1


# A Unix socket's path holds at most 107 bytes on Linux. multiprocessing, which DataLoader
# workers use to hand batches over, binds its sockets at {tmp}/pymp-XXXXXXXX/listener-XXXXXXXX.
MAX_WORKER_TMPDIR = 107 - len("/pymp-12345678/listener-12345678")


def check_worker_tmpdir(num_workers: int):
    """With DataLoader workers, the temp folder's path must be short enough for
    multiprocessing's sockets. A longer one fails inside a worker's background thread,
    not in the trainer, which would wait for its first batch forever. (Clusters often set
    a long per-job TMPDIR.) Checked per process before any process group is made."""
    if num_workers == 0:
        return
    tmp = tempfile.gettempdir()  # where multiprocessing puts them: TMPDIR, else TEMP, TMP, /tmp
    length = len(os.fsencode(tmp))
    if length > MAX_WORKER_TMPDIR:
        raise UserError(f"--num_workers {num_workers}: the temp folder {tmp} (TMPDIR) is {length} bytes long, but "
                        f"DataLoader workers pass batches through sockets under it that allow {MAX_WORKER_TMPDIR}: "
                        f"set TMPDIR to a shorter folder, or pass --num_workers 0")
