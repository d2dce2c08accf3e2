"""
Pretraining data read straight from a JSONL file: one {"text": "..."} object per line.

The file is never loaded into RAM. One scan at construction time records the byte offset
of every non-blank line (and validates it, so a bad line fails before training starts);
samples are then read on demand with seek + readline.

The reading and validation code here is also used by scripts/prepare_data.py, so both
paths accept exactly the same files and report problems with the same messages.
"""

import json
import os
from array import array
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from common.errors import DataError
from common.labels import IGNORE_INDEX

EXPECTED = 'each line must be a JSON object like {"text": "..."}'
NEEDS_TEXT = 'a .jsonl file with one {"text": "..."} object per line'


# -----------------------------------------------------------------------------
# reading and validating JSONL

def open_data_file(path, flag="--data_path"):
    """Open a data file in binary mode, turning the usual mistakes into DataError (naming `flag`)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: not found: pass {flag} an existing .jsonl file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory: pass {flag} a .jsonl file inside it")
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror}): check the path and its permissions")


def iter_raw_lines(path, flag="--data_path", needs=NEEDS_TEXT):
    """
    Yield (line_number, byte_offset, raw_bytes) for every non-blank line, streaming.
    Blank (whitespace-only) lines are skipped but still counted, so line numbers match
    what an editor shows. Raises DataError if the file has no non-blank line at all
    (`flag` and `needs`: the flag that named the file and what it should hold, for the message).
    """
    with open_data_file(path, flag) as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise DataError(f"{path}: file is empty (0 bytes): pass {flag} {needs}")
        offset = 0
        found = False
        for line_number, raw in enumerate(f, start=1):
            if raw.strip():
                found = True
                yield line_number, offset, raw
            offset += len(raw)
    if not found:
        raise DataError(f"{path}: contains only blank lines: pass {flag} {needs}")


def parse_line(raw, path, line_number):
    """Return the "text" string of one raw JSONL line, or raise a DataError naming the line."""
    where = f"{path}:{line_number}"
    try:
        # utf-8-sig only on line 1: editors on Windows like to prepend a byte-order mark
        line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                        f"of the line); re-save the file as UTF-8") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}); {EXPECTED}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got a JSON {_json_type(obj)}; {EXPECTED}")
    if "text" not in obj:
        keys = ", ".join(json.dumps(k) for k in list(obj)[:5]) or "none"
        raise DataError(f'{where}: JSON object has no "text" field (keys: {keys}); {EXPECTED}')
    text = obj["text"]
    if not isinstance(text, str):
        raise DataError(f'{where}: "text" must be a string, got a JSON {_json_type(text)}; {EXPECTED}')
    return text


def load_json_line(raw: bytes, where: str, expected: str):
    """The JSON value of one raw JSONL line (a leading byte-order mark allowed), or a DataError
    naming `where` and ending with what the line should hold (`expected`)."""
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise DataError(f"{where}: not valid UTF-8; re-save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}); {expected}") from None


def _json_type(value):
    names = {dict: "object", list: "array", str: "string", bool: "boolean",
             int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def load_tokenizer(path):
    """The tokenizer folder at `path` (tokenizer.json and its config), or a DataError."""
    from transformers import AutoTokenizer  # slow import; only needed here

    if not (Path(path) / "tokenizer.json").is_file():
        raise DataError(f"--tokenizer_path {path}: no tokenizer.json there: pass the folder of a tokenizer "
                        f"trained with trainer/train_tokenizer.py")
    try:
        # Never trust_remote_code: a tokenizer folder is user input, and its code would run here.
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds for a broken or foreign folder
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise DataError(f"--tokenizer_path {path}: cannot be loaded ({type(e).__name__}: {first}): pass the folder "
                        f"of a tokenizer trained with trainer/train_tokenizer.py") from None


def frame_document(ids, bos_id, eos_id, max_length):
    """BOS + tokens + EOS, the tokens cut so that the whole fits in max_length (EOS kept)."""
    return [bos_id] + ids[:max_length - 2] + [eos_id]


def iter_jsonl_texts(path):
    """Yield (line_number, text) for every non-blank line of a JSONL file, validated, streaming."""
    for line_number, _, raw in iter_raw_lines(path):
        yield line_number, parse_line(raw, path, line_number)


# -----------------------------------------------------------------------------
# the dataset

class PretrainDataset(Dataset):
    """
    One sample per JSONL line: [bos] + tokens + [eos], truncated to max_length and right-padded.
    labels are the input ids with -100 on padding; they are NOT shifted (MiniMind's layout:
    the model shifts). The trainer reads it through NextTokenTargets.
    """

    def __init__(self, data_path, tokenizer, max_length):
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 (room for BOS and EOS), got {max_length}")
        self.data_path = str(data_path)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.bos_id, self.eos_id, self.pad_id = _special_ids(tokenizer)
        self.offsets, self.line_numbers = self._index(self.data_path)
        self._file = None  # opened lazily, once per process (see _read_line)
        self._file_pid = None

    @staticmethod
    def _index(path):
        # array('q') keeps 8 bytes per line; a Python list of ints would cost ~4x that
        offsets, line_numbers = array("q"), array("q")
        for line_number, offset, raw in iter_raw_lines(path):
            parse_line(raw, path, line_number)  # validate now, not halfway through training
            offsets.append(offset)
            line_numbers.append(line_number)
        return np.frombuffer(offsets, dtype=np.int64), np.frombuffer(line_numbers, dtype=np.int64)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, index):
        text = self._read_line(index)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        ids = frame_document(ids, self.bos_id, self.eos_id, self.max_length)
        n = len(ids)
        input_ids = torch.full((self.max_length,), self.pad_id, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        # mask by position, not by value, so a real token that happens to equal pad still counts
        labels[n:] = IGNORE_INDEX
        return input_ids, labels

    def _read_line(self, index):
        # A handle opened before a DataLoader forks its workers would share one file position
        # between processes, so each process opens its own on first use.
        if self._file is None or self._file_pid != os.getpid():
            self._file = open(self.data_path, "rb")
            self._file_pid = os.getpid()
        self._file.seek(int(self.offsets[index]))
        raw = self._file.readline()
        return parse_line(raw, self.data_path, int(self.line_numbers[index]))

    def __getstate__(self):
        # open files don't pickle (spawn-started workers); the worker reopens its own
        state = self.__dict__.copy()
        state["_file"] = None
        state["_file_pid"] = None
        return state


class NextTokenTargets(Dataset):
    """A dataset of (input_ids, labels) in MiniMind's layout as (input_ids, next-token targets):
    targets[t] is the token after input_ids[t], -100 where there is none to predict. Every
    dataset the trainer reads yields this layout (a packed window's is already), so nothing
    downstream asks which kind of data it has."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        input_ids, labels = self.dataset[index]
        return input_ids, torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])


def _special_ids(tokenizer):
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if None in ids:
        raise ValueError(f"tokenizer must define bos, eos and pad tokens; got ids "
                         f"bos={ids[0]} eos={ids[1]} pad={ids[2]}")
    return ids
