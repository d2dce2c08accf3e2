"""
A packed corpus split into shards: a directory of .bin files (each with its .bin.json
sidecar, see packed_dataset.py) and a manifest that lists them in stream order.

    DIR/00000-a.bin  DIR/00000-a.bin.json  DIR/00001-b.bin ...  shards, one or more per input file
    DIR/manifest.json  {"format": "minimind-shards-v1", "shards": [{"path", "num_tokens",
                        "num_docs"}, ...], totals, tokenizer facts, and "runs": the figures
                        of the prepare_data.py run(s) that wrote it}
    DIR/.prep/       prepare_data.py's bookkeeping while it works (what is done so far)

Training reads the shards as ONE token stream, in manifest order, cut into windows
exactly as a single .bin made from the concatenated inputs would be: a window may span
the end of one shard and the start of the next. So every sampler guarantee of the
single-file path (each window once per epoch over all ranks, the same order at any
world size, bitwise resume) holds unchanged, and the shard layout does not change
what is trained on.
"""

import json
from pathlib import Path

import numpy as np

from common.storage import atomic_write_text
from common.errors import DataError
from dataset.packed_dataset import DTYPES, PackedPretrainDataset, is_count, not_counts, read_meta
from dataset.sources import resolve_data_paths

MANIFEST = "manifest.json"
PREP_DIR = ".prep"
FORMAT = "minimind-shards-v1"
SHARED_KEYS = ("dtype", "vocab_size", "bos_token_id", "eos_token_id")  # must agree across shards
RERUN = "re-run scripts/prepare_data.py with the same flags (it redoes only what is incomplete)"


def write_json_atomic(path, obj):
    """A reader sees all or nothing, and two machines writing the same file at once cannot interleave."""
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n", shared=True)


def write_manifest(out_dir, common, shards, runs):
    """common: the SHARED_KEYS and tokenizer; shards: [{"path", "num_tokens", "num_docs"}] in order."""
    manifest = {"format": FORMAT, **common,
                "num_tokens": sum(s["num_tokens"] for s in shards),
                "num_docs": sum(s["num_docs"] for s in shards),
                "num_shards": len(shards), "shards": shards, "runs": runs}
    write_json_atomic(Path(out_dir) / MANIFEST, manifest)
    return manifest


def read_manifest(path):
    """[(shard path, num_tokens)] and the shared metadata of a manifest, every shard checked
    to exist with the size the manifest promises (a stat each: cheap for 1,000 shards)."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e}); {RERUN}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest; {RERUN}")
    try:
        itemsize = np.dtype(DTYPES[manifest["dtype"]]).itemsize
        shards = [(path.parent / s["path"], s["num_tokens"]) for s in manifest["shards"]]
        meta = {k: manifest[k] for k in (*SHARED_KEYS, "tokenizer", "num_tokens", "num_docs")}
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: corrupt manifest (bad or missing {e}); {RERUN}") from None
    wrong = not_counts(meta, ("vocab_size", "bos_token_id", "eos_token_id", "num_tokens", "num_docs"))
    wrong += [f"{shard.name}'s num_tokens" for shard, n in shards if not is_count(n)]
    if wrong:
        raise DataError(f"{path}: corrupt manifest ({', '.join(wrong)} not a non-negative integer); {RERUN}")
    for shard, num_tokens in shards:
        size = shard.stat().st_size if shard.is_file() else None
        if size != num_tokens * itemsize:
            found = "missing" if size is None else f"{size} bytes"
            raise DataError(f"{shard}: {found}, but {path.name} says {num_tokens} tokens x {itemsize} "
                            f"bytes; {RERUN}")
    return shards, meta


def find_token_shards(source, flag="--data_path"):
    """The shards named by source -- a manifest, a directory (with or without a manifest) or
    a glob of .bin files -- as ([(path, num_tokens)], shared metadata)."""
    path = Path(source)
    if path.is_file() and path.name == MANIFEST:
        return read_manifest(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        return read_manifest(path / MANIFEST)
    if path.is_dir() and (path / PREP_DIR).is_dir():
        done = len(list((path / PREP_DIR).glob("input-*.json")))
        raise DataError(f"{flag} {path}: prepare_data.py has not finished here ({done} input files done, no "
                        f"{MANIFEST} yet); wait for every --shard_index to finish, or {RERUN}")
    shards, metas = [], []
    for bin_path in resolve_data_paths(source, (".bin",), flag):
        metas.append(read_meta(bin_path))
        shards.append((bin_path, metas[-1]["num_tokens"]))
    for (bin_path, _), meta in zip(shards, metas):
        differing = [k for k in SHARED_KEYS if meta[k] != metas[0][k]]
        ours, first = meta.get("tokenizer_sha256"), metas[0].get("tokenizer_sha256")
        if ours and first and ours != first:  # the tokenizer itself (sidecars from before it was recorded lack it)
            differing.append("tokenizer_sha256")
        if differing:
            key = differing[0]
            raise DataError(f"{bin_path}: {key} {meta[key]} differs from {metas[0][key]} in {shards[0][0].name}; "
                            f"tokenize all shards with one tokenizer")
    meta = {k: metas[0][k] for k in (*SHARED_KEYS, "tokenizer")}
    meta.update(num_tokens=sum(m["num_tokens"] for m in metas), num_docs=sum(m["num_docs"] for m in metas))
    return shards, meta


class ShardedPackedDataset(PackedPretrainDataset):
    """The windows of a sharded packed corpus, read as one token stream (see the module doc)."""

    def __init__(self, source, max_length, vocab_size=None, tokenizer=None, max_open=8):
        shards, meta = find_token_shards(source)
        self._setup(str(source), shards, meta, max_length, vocab_size, tokenizer, max_open)
