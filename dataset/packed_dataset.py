"""
Packed pretraining data: every document tokenized once (by scripts/prepare_data.py) into one
flat token stream on disk, served as fixed-length windows with no padding at all.

On disk:
    corpus.bin       the stream, BOS + tokens + EOS per document, concatenated (uint16 or uint32)
    corpus.bin.json  sidecar: {"format": "minimind-packed-v1", "dtype", "vocab_size", "num_tokens",
                     "num_docs", "bos_token_id", "eos_token_id", "tokenizer"}

Window i is stream[i*T : i*T + T + 1]. Consecutive windows share one boundary token, so every
token of the stream except the very first is a prediction target exactly once.
"""

import json
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.data import Dataset

from dataset.lm_dataset import DataError

FORMAT = "minimind-packed-v1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
META_KEYS = ("format", "dtype", "vocab_size", "num_tokens", "num_docs",
             "bos_token_id", "eos_token_id", "tokenizer")
RERUN = "re-run scripts/prepare_data.py to rebuild it"


def meta_path(bin_path):
    return Path(str(bin_path) + ".json")


def dtype_for_vocab(vocab_size):
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def write_meta(bin_path, *, vocab_size, num_tokens, num_docs, bos_token_id, eos_token_id,
               tokenizer, dtype=None):
    """Write the JSON sidecar next to bin_path and return the dict written."""
    meta = {
        "format": FORMAT,
        "dtype": dtype or dtype_for_vocab(vocab_size),
        "vocab_size": int(vocab_size),
        "num_tokens": int(num_tokens),
        "num_docs": int(num_docs),
        "bos_token_id": int(bos_token_id),
        "eos_token_id": int(eos_token_id),
        "tokenizer": str(tokenizer),
    }
    with open(meta_path(bin_path), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return meta


def read_meta(bin_path):
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
    if meta.get("format") != FORMAT:
        raise DataError(f"{side}: format is {meta.get('format')!r}, expected {FORMAT!r}; {RERUN}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DataError(f"{side}: corrupt metadata, missing {', '.join(missing)}; {RERUN}")
    not_ints = [k for k in META_KEYS[2:7] if not isinstance(meta[k], int) or meta[k] < 0]
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
    """Non-overlapping windows of max_length+1 tokens; labels come already shifted, no -100."""

    labels_are_shifted = True

    def __init__(self, bin_path, max_length, vocab_size=None, tokenizer=None):
        self.bin_path = str(bin_path)
        self.max_length = max_length
        self.meta = meta = read_meta(bin_path)
        if tokenizer is not None and len(tokenizer) != meta["vocab_size"]:
            raise DataError(f"{bin_path}: was tokenized with vocab_size {meta['vocab_size']} "
                            f"({meta['tokenizer']}) but the tokenizer in use has {len(tokenizer)} tokens; "
                            f"re-run scripts/prepare_data.py with this tokenizer")
        if vocab_size is not None and meta["vocab_size"] > vocab_size:
            raise DataError(f"{bin_path}: token ids go up to vocab_size {meta['vocab_size']} but the model's "
                            f"vocab_size is {vocab_size}; raise the model's vocab_size or re-tokenize")
        if meta["num_tokens"] < max_length + 1:
            raise DataError(f"{bin_path}: has {meta['num_tokens']} tokens, fewer than one window of "
                            f"max_length+1 = {max_length + 1}; use more data or a smaller max_length")
        self.num_tokens = meta["num_tokens"]
        self.bos_token_id = meta["bos_token_id"]
        self.eos_token_id = meta["eos_token_id"]
        self._dtype = DTYPES[meta["dtype"]]
        self._tokens = None  # np.memmap, opened lazily in each process (see _stream)

    def __len__(self):
        return (self.num_tokens - 1) // self.max_length

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.max_length
        window = self._stream()[start:start + self.max_length + 1]
        window = torch.from_numpy(window.astype(np.int64))
        return window[:-1], window[1:]

    def _stream(self):
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self._dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self):
        # a pickled memmap turns into a full in-RAM copy; send workers the path instead
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state


def document_ids(input_ids, bos_token_id):
    """(B, T) index of the document each position belongs to. A document starts at each BOS;
    tokens before the window's first BOS (the tail of a document that began in an earlier
    window) form a document of their own."""
    return torch.cumsum((input_ids == bos_token_id).to(torch.int32), dim=1)


def document_causal_mask(input_ids, bos_token_id, flex=None):
    """
    Attention mask, causal and within the same document, in the form the model runs fastest:
    flex=None picks a FlexAttention BlockMask on CUDA and the dense mask elsewhere
    (scripts/bench_attention.py: FlexAttention has no backward on CPU).
    """
    if flex is None:
        flex = input_ids.is_cuda
    return document_block_mask(input_ids, bos_token_id) if flex else dense_document_mask(input_ids, bos_token_id)


def dense_document_mask(input_ids, bos_token_id):
    """(B, 1, T, T) bool, True = may attend. The diagonal is always True, so no row is fully
    masked (which would give NaN in SDPA)."""
    doc_ids = document_ids(input_ids, bos_token_id)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    T = input_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def document_block_mask(input_ids, bos_token_id):
    """The same mask as a FlexAttention BlockMask: blocks of 128 x 128 positions that lie
    wholly outside every document are never computed."""
    doc_ids = document_ids(input_ids, bos_token_id)

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    B, T = input_ids.shape
    return create_block_mask(causal_same_document, B, None, T, T, device=input_ids.device)
