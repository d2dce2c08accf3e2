"""
Packed pretraining data: every document tokenized once (by scripts/prepare_data.py) into one
flat token stream on disk, served as fixed-length windows with no padding at all.

On disk:
    corpus.bin       the stream, BOS + tokens + EOS per document, concatenated (uint16 or uint32)
    corpus.bin.json  sidecar: {"format": "minimind-packed-v1", "dtype", "vocab_size", "num_tokens",
                     "num_docs", "bos_token_id", "eos_token_id", "tokenizer"}, and from prepare_data.py
                     also "max_token_id" with the .bin's size and mtime when it was counted

Window i is stream[i*T : i*T + T + 1]. Consecutive windows share one boundary token, so every
token of the stream except the very first, and a tail shorter than a window, is a prediction
target exactly once.

The stream may also be a directory of such files (dataset/shards.py), read as their
concatenation: the windows are the same as those of one file holding all of it.
"""

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from common.errors import DataError
from common.storage import atomic_write_text

FORMAT = "minimind-packed-v1"
SFT_FORMAT = "minimind-sft-packed-v1"  # conversations, with their loss spans (dataset/sft_dataset.py)
WHICH_SCRIPT = {FORMAT: "trainer/train_pretrain.py", SFT_FORMAT: "trainer/train_full_sft.py"}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
META_KEYS = ("format", "dtype", "vocab_size", "num_tokens", "num_docs",
             "bos_token_id", "eos_token_id", "tokenizer")
RERUN = "re-run scripts/prepare_data.py to rebuild it"


def meta_path(bin_path):
    return Path(str(bin_path) + ".json")


def dtype_for_vocab(vocab_size):
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def write_meta(bin_path, *, vocab_size, num_tokens, num_docs, bos_token_id, eos_token_id,
               tokenizer, dtype=None, max_token_id=None, format_=FORMAT, to=None, **extra):
    """Write the JSON sidecar of the finished bin_path and return the dict written: beside it
    (atomically), or into `to`, a text file open for writing (a writer's temp sidecar, bin_path then the
    temp file its bytes wait in). max_token_id (the writer saw every token) is stamped with the
    file's size and mtime, which a rename keeps, so a reader trusts it only for the very file it
    was counted on. `extra`: a format's own keys."""
    meta = {
        "format": format_,
        "dtype": dtype or dtype_for_vocab(vocab_size),
        "vocab_size": int(vocab_size),
        "num_tokens": int(num_tokens),
        "num_docs": int(num_docs),
        "bos_token_id": int(bos_token_id),
        "eos_token_id": int(eos_token_id),
        "tokenizer": str(tokenizer),
        **extra,
    }
    if max_token_id is not None:
        stat = os.stat(bin_path)
        meta.update(max_token_id=int(max_token_id), bin_bytes=stat.st_size, bin_mtime_ns=stat.st_mtime_ns)
    text = json.dumps(meta, indent=2) + "\n"
    if to is None:
        atomic_write_text(meta_path(bin_path), text, "the metadata")
    else:
        to.write(text)
    return meta


def is_count(value) -> bool:
    """A non-negative integer (a bool is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def not_counts(meta: dict, keys) -> list[str]:
    """The keys whose values are no counts."""
    return [k for k in keys if not is_count(meta[k])]


def read_meta(bin_path, format_=FORMAT):
    """Read and check the sidecar of bin_path, including that the .bin has the size it promises."""
    bin_path, side = Path(bin_path), meta_path(bin_path)
    if not bin_path.is_file():
        raise DataError(f"{bin_path}: not found: create it with scripts/prepare_data.py "
                        f"--data_path <corpus.jsonl> --out_path {bin_path}")
    if not side.is_file():
        raise DataError(f"{side}: not found (metadata for {bin_path.name}); {RERUN}")
    try:
        meta = json.loads(side.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{side}: corrupt metadata, not valid JSON ({e}); {RERUN}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{side}: corrupt metadata, expected a JSON object; {RERUN}")
    if meta.get("format") in WHICH_SCRIPT and meta["format"] != format_:
        raise DataError(f"{bin_path}: is {meta['format']} data, which {WHICH_SCRIPT[meta['format']]} trains on; "
                        f"this script reads {format_} (scripts/prepare_data.py{' --sft' if format_ == SFT_FORMAT else ''})")
    if meta.get("format") != format_:
        raise DataError(f"{side}: format is {meta.get('format')!r}, expected {format_!r}; {RERUN}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DataError(f"{side}: corrupt metadata, missing {', '.join(missing)}; {RERUN}")
    not_ints = not_counts(meta, META_KEYS[2:7])
    if not_ints:
        raise DataError(f"{side}: corrupt metadata, {', '.join(not_ints)} not a non-negative "
                        f"integer; {RERUN}")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{side}: unknown dtype {meta['dtype']!r}, expected uint16 or uint32; {RERUN}")
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    expected, actual = meta["num_tokens"] * itemsize, bin_path.stat().st_size
    if actual != expected:
        raise DataError(f"{bin_path}: size is {actual} bytes but {side.name} says {meta['num_tokens']} "
                        f"tokens x {itemsize} bytes = {expected}; the file is truncated or stale, {RERUN}")
    return meta


class PackedPretrainDataset(Dataset):
    """Non-overlapping windows of max_length+1 tokens as (input_ids, next-token targets), no -100.

    The stream may be split over several shards (see dataset/shards.py): they are read as
    one stream, so a window may begin in one shard and end in the next. Shards are
    memory-mapped lazily, in each process, and at most `max_open` at a time.
    """

    def __init__(self, bin_path, max_length, vocab_size=None, tokenizer=None):
        meta = read_meta(bin_path)
        self._setup(str(bin_path), [(str(bin_path), meta["num_tokens"])], meta, max_length, vocab_size,
                    tokenizer)

    def _setup(self, name, shards, meta, max_length, vocab_size, tokenizer, max_open=8):
        """name: what error messages call the data; shards: [(path, num_tokens)] in stream order."""
        self.bin_path = name
        self.max_length = max_length
        self.meta = meta
        check_fits(name, meta, max_length, vocab_size, tokenizer)
        shards = [(path, n) for path, n in shards if n > 0]  # an empty shard holds no window and cannot be mapped
        if vocab_size is not None:
            for path, _ in shards:
                check_token_ids(path, DTYPES[meta["dtype"]], vocab_size)
        self.shard_paths = [str(path) for path, _ in shards]
        # shard s holds stream positions [starts[s], starts[s + 1])
        self._starts = np.concatenate([[0], np.cumsum([n for _, n in shards], dtype=np.int64)])
        self.num_tokens = int(self._starts[-1])
        self.bos_token_id = meta["bos_token_id"]
        self.eos_token_id = meta["eos_token_id"]
        self._dtype = DTYPES[meta["dtype"]]
        self.max_open = max_open
        self._open = OrderedDict()  # shard index -> np.memmap, least recently used first
        self._open_pid = None

    def __len__(self):
        return (self.num_tokens - 1) // self.max_length

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.max_length
        window = torch.from_numpy(self._read(start, start + self.max_length + 1).astype(np.int64))
        return window[:-1], window[1:]

    def _read(self, start, stop):
        """Stream positions [start, stop), gathered from as many shards as they span."""
        pieces = []
        s = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[s + 1]))
            offset = int(self._starts[s])
            pieces.append(self._shard(s)[start - offset:end - offset])
            start, s = end, s + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _shard(self, s):
        # A map inherited through fork is fine to read, but the cache is per process so
        # that eviction in one worker never touches another's.
        if self._open_pid != os.getpid():
            self._open, self._open_pid = OrderedDict(), os.getpid()
        tokens = self._open.get(s)
        if tokens is None:
            # each open memmap holds a file descriptor and a mapping; keep a few, not one per shard
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)
            n = int(self._starts[s + 1] - self._starts[s])
            tokens = np.memmap(self.shard_paths[s], dtype=self._dtype, mode="r", shape=(n,))
            self._open[s] = tokens
        else:
            self._open.move_to_end(s)
        return tokens

    def __getstate__(self):
        # a pickled memmap turns into a full in-RAM copy; send workers the paths instead
        state = self.__dict__.copy()
        state["_open"], state["_open_pid"] = OrderedDict(), None
        return state


def largest_token_id(bin_path, dtype, chunk=1 << 26) -> int:
    """The largest id in a .bin: the sidecar's count when it was made for this very file (same
    size and mtime), else a scan of the file in chunks (about half a second per GB)."""
    bin_path, side = Path(bin_path), meta_path(bin_path)
    stat = bin_path.stat()
    try:
        meta = json.loads(side.read_text())
        if (meta.get("bin_bytes"), meta.get("bin_mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
            return int(meta["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # AttributeError: not a JSON object
        pass
    if stat.st_size == 0:
        return -1  # np.memmap cannot map an empty file
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


def check_token_ids(bin_path, dtype, vocab_size):
    """Every id in the file fits the model's embedding: a larger one would fail mid-run (on CUDA
    as a device-side assert that kills the process)."""
    largest = largest_token_id(bin_path, dtype)
    if largest >= vocab_size:
        raise DataError(f"{bin_path}: holds token id {largest}, but the model's vocab_size is {vocab_size} "
                        f"(ids 0 to {vocab_size - 1}); re-run scripts/prepare_data.py with the model's "
                        f"tokenizer, or train with a larger --vocab_size")


def check_fits(name, meta, max_length, vocab_size=None, tokenizer=None):
    """The stream described by meta suits this tokenizer, model vocab and window length."""
    if tokenizer is not None and len(tokenizer) != meta["vocab_size"]:
        raise DataError(f"{name}: was tokenized with vocab_size {meta['vocab_size']} "
                        f"({meta['tokenizer']}) but the tokenizer in use has {len(tokenizer)} tokens; "
                        f"re-run scripts/prepare_data.py with this tokenizer")
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise DataError(f"{name}: token ids go up to vocab_size {meta['vocab_size']} but the model's "
                        f"vocab_size is {vocab_size}; raise the model's vocab_size or re-tokenize")
    if meta["num_tokens"] < max_length + 1:
        raise DataError(f"{name}: has {meta['num_tokens']} tokens, fewer than one window of "
                        f"max_length+1 = {max_length + 1}; use more data or a smaller max_length")
