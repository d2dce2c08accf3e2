"""
Where prepare_data.py writes: one .bin stream, or a directory of shards that several
machines fill at once and that a killed run resumes.

A shard directory (format: dataset/shards.py) is cut by input file: input file i (in
the sorted input list) becomes the shards "{i:05d}-{stem}[-{part:04d}].bin", and machine
I of N tokenizes the inputs i with i % N == I. No two machines ever write the same
file, so they need no locks, only a shared directory:

    .prep/plan.json          the inputs and settings; a run with other ones is refused
    .prep/input-{i:05d}.json the shards of input i, written last, once they are complete
    .prep/run-{I}-of-{N}.json the figures of machine I's last run
    manifest.json            all shards in order, by whichever machine completes the set

Shards are written under a temp name and renamed once the whole input is done, so a
killed run leaves no file a reader takes for complete; the next run deletes what a
killed one left of an input and redoes it, and skips every input with a record. Every
file is a common/storage.py AtomicFile, fsynced: all the files of a .bin (its sidecar,
an SFT file's blocks), or of one input's shards, are on disk before the first is renamed,
so a full disk leaves none of them in place, and its StorageError names the file in one line.
"""

import json
from pathlib import Path

import numpy as np

from common.errors import DataError
from common.storage import AtomicFile
from dataset.packed_dataset import DTYPES, SFT_FORMAT, meta_path, write_meta
from dataset.sft_dataset import block_rows, blocks_path
from dataset.shards import PREP_DIR, SHARED_KEYS, write_json_atomic, write_manifest


# What a failed write's line says to do, besides freeing space.
AFTER_A_FAILED_WRITE = dict(elsewhere="pass another --out_path",
                            then=", then run it again (a directory of shards keeps the files it finished)")


def temp_file(path, what: str, mode: str = "wb") -> AtomicFile:
    return AtomicFile(path, what, mode, **AFTER_A_FAILED_WRITE)


def commit_all(files):
    """All of an output's files on disk before the first is renamed: a full disk (which fsync
    may be the first to report) then leaves none of them in place."""
    for f in files:
        f.close()
    for f in files:
        f.commit()


def add_sidecar(files: list, data: AtomicFile, figures: dict):
    """Close `data` (its size and mtime are final then) and write its sidecar as a temp file too,
    last in `files`: renamed after the data, and removed with the rest by an abort."""
    data.close()
    sidecar = temp_file(meta_path(data.path), "the packed tokens' metadata", "w")
    files.append(sidecar)
    write_meta(data.tmp, to=sidecar, **figures)


class StreamWriter:
    """Every input as one stream into out_path (+ sidecar), renamed into place when complete."""

    def __init__(self, out_path, common):
        self.out_path, self.common = Path(out_path), common
        self.files = []  # the temp files: the tokens first, then whatever goes with them
        self.num_tokens, self.num_docs, self.max_token_id = 0, 0, -1

    def start_input(self, index):
        if not self.files:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.files.append(temp_file(self.out_path, "the packed tokens"))

    def write(self, tokens, doc_lens):
        # not tofile: a full disk then names its errno
        self.files[0].write(memoryview(np.ascontiguousarray(tokens)))
        self.num_tokens += len(tokens)
        self.num_docs += len(doc_lens)
        self.max_token_id = max(self.max_token_id, int(tokens.max()) if len(tokens) else -1)

    def finish_input(self, index):
        pass

    def close(self):
        if not self.files or self.num_docs == 0:
            self.abort()
            raise DataError(f"{self.out_path}: every non-blank line of the input is bad, nothing to write; "
                            f"fix the input or pass other files")
        add_sidecar(self.files, self.files[0], dict(num_tokens=self.num_tokens, num_docs=self.num_docs,
                                                    max_token_id=self.max_token_id, **self.common))
        commit_all(self.files)

    def abort(self):
        for f in self.files:
            f.discard()


class SFTWriter(StreamWriter):
    """Conversations (dataset/chat.py's Encoded) as one packed SFT stream: the tokens, and the
    blocks table beside them (dataset/sft_dataset.py), renamed into place when complete."""

    def __init__(self, out_path, common):
        super().__init__(out_path, dict(common, format_=SFT_FORMAT))
        self.num_blocks, self.trained_tokens = 0, 0

    def write_conversations(self, conversations):
        if not self.files:
            self.start_input(0)
            self.files.append(temp_file(blocks_path(self.out_path), "the packed conversations' blocks"))
        dtype, first = DTYPES[self.common["dtype"]], self.num_tokens
        rows = []
        for k, encoded in enumerate(conversations):
            rows.append(block_rows(encoded, first, self.num_docs + k))
            first += len(encoded.ids)
            self.trained_tokens += sum(encoded.trained)
        tokens = np.fromiter((i for e in conversations for i in e.ids), dtype=dtype, count=first - self.num_tokens)
        table = np.concatenate(rows) if rows else np.empty((0, 4), dtype=np.int64)
        self.files[1].write(memoryview(table))
        self.num_blocks += len(table)
        self.write(tokens, [len(e.ids) for e in conversations])

    def close(self):
        if self.num_docs and not self.trained_tokens:
            self.abort()
            raise DataError(f"{self.out_path}: no assistant turn in any conversation of the input: fine-tuning "
                            f"trains on the assistant's replies")
        self.common["num_blocks"] = self.num_blocks
        super().close()


class ShardDirectory:
    """The shards of this machine's inputs in out_dir, and the manifest once all are there."""

    def __init__(self, out_dir, inputs, common, shard_tokens, text_column):
        self.dir, self.prep = Path(out_dir), Path(out_dir) / PREP_DIR
        self.inputs = dict(inputs)  # index -> path, for ALL machines' inputs
        self.common, self.shard_tokens = common, shard_tokens
        self.itemsize = np.dtype(DTYPES[common["dtype"]]).itemsize
        if self.dir.exists() and not self.dir.is_dir():
            raise DataError(f"--out_path {self.dir}: is a file; pass a directory for shards, or a .bin path")
        self.prep.mkdir(parents=True, exist_ok=True)
        self._check_plan({"inputs": [[p.name, p.stat().st_size] for _, p in inputs],
                          **{k: common[k] for k in (*SHARED_KEYS, "tokenizer_sha256")},
                          "shard_tokens": shard_tokens, "text_column": text_column})
        self.shard, self.parts, self.files, self.max_token_ids = None, [], [], {}

    def _check_plan(self, plan):
        path = self.prep / "plan.json"
        if path.is_file():
            old = json.loads(path.read_text())
            old.setdefault("tokenizer_sha256", plan["tokenizer_sha256"])  # a plan from before it was recorded
            differing = [k for k in plan if old.get(k) != plan[k]]
            if differing:
                raise DataError(f"--out_path {self.dir}: holds shards made with other {differing[0]} "
                                f"({'input files' if differing[0] == 'inputs' else old.get(differing[0])}); "
                                f"pass a new --out_path, or delete this one to start over")
        else:  # machines starting at once write the same content: whichever rename wins is right
            write_json_atomic(path, plan)

    def _record(self, index):
        return self.prep / f"input-{index:05d}.json"

    def is_complete(self, index):
        try:
            shards = json.loads(self._record(index).read_text())["shards"]
        except (OSError, ValueError, KeyError):
            return False
        return all((self.dir / s["path"]).is_file() and meta_path(self.dir / s["path"]).is_file()
                   and (self.dir / s["path"]).stat().st_size == s["num_tokens"] * self.itemsize
                   for s in shards)

    # ------------------------------------------------------------------ one input file
    def start_input(self, index):
        # Whatever a killed run left of this input goes: only this machine writes it.
        self._record(index).unlink(missing_ok=True)
        for stale in self.dir.glob(f"{index:05d}-*"):
            stale.unlink()
        self.index, self.parts, self.files, self.shard, self.max_token_ids = index, [], [], None, {}

    def write(self, tokens, doc_lens):
        while len(doc_lens):
            if self.shard is None:
                self._open_part()
            part, take_docs = self.parts[-1], len(doc_lens)
            if self.shard_tokens:  # up to the first document end at or past shard_tokens
                ends = np.cumsum(doc_lens)
                take_docs = min(take_docs, int(np.searchsorted(ends, self.shard_tokens - part["num_tokens"])) + 1)
            take = int(doc_lens[:take_docs].sum())
            self.shard.write(memoryview(np.ascontiguousarray(tokens[:take])))
            if take:
                largest = self.max_token_ids.get(part["path"], -1)
                self.max_token_ids[part["path"]] = max(largest, int(tokens[:take].max()))
            part["num_tokens"] += take
            part["num_docs"] += take_docs
            tokens, doc_lens = tokens[take:], doc_lens[take_docs:]
            if self.shard_tokens and part["num_tokens"] >= self.shard_tokens:
                self.shard.close()
                self.shard = None

    def _open_part(self):
        stem = f"{self.index:05d}-{self.inputs[self.index].stem}"
        name = f"{stem}-{len(self.parts):04d}.bin" if self.shard_tokens else f"{stem}.bin"
        self.parts.append({"path": name, "num_tokens": 0, "num_docs": 0})
        self.shard = temp_file(self.dir / name, "the shard")
        self.files.append(self.shard)

    def finish_input(self, index):
        self.shard = None
        if not self.parts:
            raise DataError(f"{self.inputs[index]}: every non-blank line is bad, nothing to write; fix the "
                            f"file or leave it out of --data_path")
        for part, shard in zip(self.parts, list(self.files)):
            largest = self.max_token_ids.get(part["path"], -1)
            add_sidecar(self.files, shard, dict(num_tokens=part["num_tokens"], num_docs=part["num_docs"],
                                                max_token_id=largest, **self.common))
        commit_all(self.files)
        self.files = []
        write_json_atomic(self._record(index), {"source": self.inputs[index].name, "shards": self.parts})

    def abort(self):
        for f in self.files:
            f.discard()

    def close(self):
        pass

    # ------------------------------------------------------------------ the whole directory
    def finish_run(self, figures):
        """Record this machine's figures; write the manifest if every input is now complete.
        Returns the manifest, or None while other machines are still at work."""
        if figures["inputs"]:  # a rerun that found everything done keeps the real run's figures
            write_json_atomic(self.prep / f"run-{figures['shard_index']}-of-{figures['num_shards']}.json", figures)
        if not all(self.is_complete(i) for i in self.inputs):
            return None
        shards = [s for i in sorted(self.inputs) for s in json.loads(self._record(i).read_text())["shards"]]
        runs = sorted((json.loads(p.read_text()) for p in self.prep.glob("run-*-of-*.json")),
                      key=lambda r: (r["num_shards"], r["shard_index"]))
        return write_manifest(self.dir, self.common, shards, runs)
