"""Supervised fine-tuning data: conversations (dataset/chat.py) as (input ids, next-token
targets) samples, the targets -100 wherever the loss does not look.

Two paths, as pre-training has:
  * .jsonl, MiniMind's: one conversation per sample, right-padded to --max_seq_len (SFTDataset).
  * .bin, written by `scripts/prepare_data.py --sft`: every conversation tokenized once, and
    whole conversations packed into windows of --max_seq_len tokens (PackedSFTDataset), so
    that little of a window is padding. Its samples also carry where each conversation
    starts, so that --doc_mask keeps each conversation's attention to itself.

A conversation gives the same tokens and targets on both paths. One longer than
--max_seq_len keeps the complete blocks (turns) that fit; one that keeps no trained token is
skipped, and `skipped` counts them. The packed file on disk:

    sft.bin          the conversations' tokens, one after the other (uint16 or uint32)
    sft.bin.json     the sidecar of dataset/packed_dataset.py, format minimind-sft-packed-v1, + num_blocks
    sft.bin.blocks   int64 (num_blocks, 4): per block, in stream order, its first token, its
                     conversation, and the [start, end) of its trained tokens (equal: none)
"""
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from common.errors import DataError
from common.labels import IGNORE_INDEX
from dataset.chat import Encoded, encode, encode_many, parse_conversation, render
from dataset.lm_dataset import iter_raw_lines
from dataset.packed_dataset import DTYPES, SFT_FORMAT, check_fits, check_token_ids, read_meta

NEEDS = 'a .jsonl file of {"conversations": [...]} lines, or a .bin made by scripts/prepare_data.py --sft'
# Prepended to a conversation without one, with probability --add_system_ratio (MiniMind's augmentation).
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are MiniMind, a small language model. Answer briefly and accurately.",
    "Answer the user's question as well as you can.",
    "You are an assistant that knows the Python standard library.",
)
BLOCK_COLUMNS = 4  # first token, conversation, loss start, loss end
SIZING_BATCH = 1000  # conversations tokenized at once while a JSONL file is sized


@dataclass(frozen=True)
class ChatOptions:
    """MiniMind's two augmentations, off by default. Each sample draws from its own generator,
    seeded by (seed, sample index): a resume, and every world size, draws the same."""
    add_system_ratio: float = 0.0  # MiniMind: 0.2
    empty_think_ratio: float = 1.0  # the share of samples that keep an empty <think> block; MiniMind: 0.2
    seed: int = 0


def sample_of(encoded: Encoded, max_length: int, pad_id: int):
    """(input ids, next-token targets, document starts) of one conversation, right-padded to
    max_length. The starts say the conversation is one document: every turn opens with BOS
    (<|im_start|>), so a mask drawn at each BOS would hide the question from its answer."""
    n = len(encoded.ids)
    ids = torch.full((max_length,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(encoded.ids, dtype=torch.long)
    targets = torch.full((max_length,), IGNORE_INDEX, dtype=torch.long)
    trained = torch.tensor(encoded.trained[1:], dtype=torch.bool)
    targets[:n - 1] = torch.where(trained, ids[1:n], IGNORE_INDEX)
    starts = torch.zeros(max_length, dtype=torch.bool)
    starts[0] = True
    if n < max_length:
        starts[n] = True  # the padding is a document of its own, as in PackedSFTDataset
    return ids, targets, starts


class SFTDataset(Dataset):
    """One conversation per JSONL line, padded. Construction reads every line once: it checks
    it (a bad one is a DataError naming its line) and tokenizes it, to know which
    conversations keep a trained token within max_length; samples are re-read on demand."""

    def __init__(self, path, tokenizer, max_length: int, options: ChatOptions = ChatOptions(),
                 flag: str = "--data_path"):
        self.path, self.tokenizer, self.max_length, self.options = str(path), tokenizer, max_length, options
        self.pad_id = tokenizer.pad_token_id
        offsets, self.skipped, assistants, pending = [], 0, 0, []
        for line_number, offset, raw in iter_raw_lines(path, flag, NEEDS):
            turns = parse_conversation(raw, f"{path}:{line_number}")
            assistants += sum(turn["role"] == "assistant" for turn in turns)
            pending.append((offset, line_number, render(turns)))
            if len(pending) == SIZING_BATCH:
                offsets += self._fitting(pending)
                pending = []
        offsets += self._fitting(pending)
        if not assistants:
            raise DataError(f"{path}: no assistant turn in any of its conversations: fine-tuning trains on the "
                            f"assistant's replies; pass {flag} conversations that have them")
        self.offsets = np.array(offsets, dtype=np.int64).reshape(-1, 2)
        self._file, self._file_pid = None, None

    def _fitting(self, pending) -> list[tuple[int, int]]:
        """(offset, line number) of the pending conversations that keep a trained token within
        max_length; the others are counted in `skipped`."""
        encoded = encode_many(self.tokenizer, [blocks for _, _, blocks in pending])
        fitting = [(offset, line) for (offset, line, _), e in zip(pending, encoded) if e.cut(self.max_length)]
        self.skipped += len(pending) - len(fitting)
        return fitting

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, index):
        turns = self._read(index)
        rng = np.random.default_rng((self.options.seed, index))
        augmented = self._augmented(turns, rng)
        encoded = encode(self.tokenizer, augmented).cut(self.max_length)
        if encoded is None:  # the added system prompt pushed the replies out: train without it
            encoded = encode(self.tokenizer, render(turns)).cut(self.max_length)
        return sample_of(encoded, self.max_length, self.pad_id)

    def _augmented(self, turns, rng):
        """MiniMind's augmentations, drawn in its order: a system prompt for conversations that have
        none (and no tools), then whether empty <think> blocks stay."""
        add = self.options.add_system_ratio
        if add and turns[0]["role"] != "system" and not any("tools" in t for t in turns) and rng.random() < add:
            turns = [{"role": "system", "content": SYSTEM_PROMPTS[rng.integers(len(SYSTEM_PROMPTS))]}, *turns]
        keep = self.options.empty_think_ratio
        return render(turns, keep_empty_think=keep >= 1 or rng.random() <= keep)

    def _read(self, index):
        # Each process opens its own handle: one opened before the DataLoader forks would
        # share its file position between the workers.
        if self._file is None or self._file_pid != os.getpid():
            self._file, self._file_pid = open(self.path, "rb"), os.getpid()
        offset, line_number = (int(v) for v in self.offsets[index])
        self._file.seek(offset)
        return parse_conversation(self._file.readline(), f"{self.path}:{line_number}")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_file"], state["_file_pid"] = None, None  # workers open their own
        return state


# -----------------------------------------------------------------------------
# the packed file

def blocks_path(bin_path) -> str:
    return f"{bin_path}.blocks"


def block_rows(encoded: Encoded, first_token: int, conversation: int) -> np.ndarray:
    """The conversation's rows of the blocks table, its tokens starting at first_token in the stream."""
    rows = []
    for start, end in zip([0, *encoded.block_ends[:-1]], encoded.block_ends):
        trained = [i for i in range(start, end) if encoded.trained[i]]
        loss = (trained[0], trained[-1] + 1) if trained else (start, start)
        rows.append((first_token + start, conversation, first_token + loss[0], first_token + loss[1]))
    return np.array(rows, dtype=np.int64).reshape(-1, BLOCK_COLUMNS)


class PackedSFTDataset(Dataset):
    """Windows of max_length tokens, each holding whole conversations one after the other (in the
    file's order, as many as fit), then padding: (input ids, targets, conversation starts)."""

    def __init__(self, bin_path, max_length: int, vocab_size=None, tokenizer=None, pad_id: int = 0):
        meta = read_meta(bin_path, SFT_FORMAT)
        check_fits(bin_path, meta, 1, vocab_size, tokenizer)
        if vocab_size is not None:
            check_token_ids(bin_path, DTYPES[meta["dtype"]], vocab_size)
        self.bin_path, self.max_length, self.pad_id = str(bin_path), max_length, pad_id
        self.dtype, self.num_tokens = DTYPES[meta["dtype"]], meta["num_tokens"]
        blocks = read_blocks(bin_path, meta)
        starts, cuts = conversation_cuts(blocks, meta["num_docs"], self.num_tokens, max_length)
        self.skipped = int(np.sum(cuts == starts))
        kept = cuts > starts
        self.starts, self.cuts = starts[kept], cuts[kept]
        self.windows = pack_windows(self.cuts - self.starts, max_length)  # [first, stop) conversations
        # Trained spans, in stream order, for the mask of a window's tokens.
        self.loss = blocks[blocks[:, 3] > blocks[:, 2]][:, 2:]
        self._tokens, self._tokens_pid = None, None

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        first, stop = (int(v) for v in self.windows[index])
        ids = torch.full((self.max_length,), self.pad_id, dtype=torch.long)
        trained = torch.zeros(self.max_length + 1, dtype=torch.bool)
        starts = torch.zeros(self.max_length, dtype=torch.bool)
        at = 0
        for start, cut in zip(self.starts[first:stop], self.cuts[first:stop]):
            start, cut = int(start), int(cut)
            ids[at:at + cut - start] = torch.from_numpy(self._stream()[start:cut].astype(np.int64))
            for loss_start, loss_end in self._spans(start, cut):
                trained[at + loss_start - start:at + loss_end - start] = True
            starts[at] = True
            at += cut - start
        if at < self.max_length:
            starts[at] = True  # the padding is a document of its own
        # A conversation's first token is never trained, so no target crosses into the next one.
        targets = torch.where(trained[1:], torch.cat([ids[1:], ids.new_full((1,), self.pad_id)]), IGNORE_INDEX)
        return ids, targets, starts

    def _spans(self, start: int, cut: int):
        lo, hi = np.searchsorted(self.loss[:, 0], [start, cut])
        return ((int(a), int(b)) for a, b in self.loss[lo:hi])

    def _stream(self):
        if self._tokens_pid != os.getpid():  # a map per process, not one pickled to the workers
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
            self._tokens_pid = os.getpid()
        return self._tokens

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"], state["_tokens_pid"] = None, None
        return state


def read_blocks(bin_path, meta) -> np.ndarray:
    path = blocks_path(bin_path)
    num_blocks = meta.get("num_blocks")
    expected = (num_blocks or 0) * BLOCK_COLUMNS * 8
    if not isinstance(num_blocks, int) or not os.path.isfile(path) or os.path.getsize(path) != expected:
        raise DataError(f"{path}: missing, or not the {num_blocks} blocks {bin_path}.json promises; re-run "
                        f"scripts/prepare_data.py --sft to rebuild it")
    return np.fromfile(path, dtype=np.int64).reshape(-1, BLOCK_COLUMNS)


def conversation_cuts(blocks: np.ndarray, num_conversations: int, num_tokens: int, max_length: int):
    """(first token, end of the kept part) of every conversation: its longest run of complete blocks
    within max_length tokens that holds a trained token; the end is the start where none does."""
    conversation = blocks[:, 1]
    block_end = np.append(blocks[1:, 0], num_tokens)
    starts = np.full(num_conversations, num_tokens, dtype=np.int64)
    np.minimum.at(starts, conversation, blocks[:, 0])
    fits = block_end - starts[conversation] <= max_length  # blocks end in order, so this keeps a prefix
    cuts = starts.copy()
    np.maximum.at(cuts, conversation[fits], block_end[fits])
    trained = np.zeros(num_conversations, dtype=np.int64)
    np.add.at(trained, conversation[fits], blocks[fits, 3] - blocks[fits, 2])
    return starts, np.where(trained > 0, cuts, starts)


def pack_windows(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """[first, stop) conversation ranges, in order: each window takes the next conversations while
    they fit (next-fit; shuffling happens at the window level, in the sampler)."""
    windows, first, used = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > max_length:
            windows.append((first, i))
            first, used = i, 0
        used += n
    if len(lengths):
        windows.append((first, len(lengths)))
    return np.array(windows, dtype=np.int64).reshape(-1, 2)
