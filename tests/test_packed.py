"""Packed token stream: window layout, prepare_data.py round trip, load-time checks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from common.errors import DataError
from dataset.packed_dataset import PackedPretrainDataset, dtype_for_vocab, meta_path, read_meta, write_meta
from dataset.shards import ShardedPackedDataset
from scripts.prepare_data import prepare
from tests.support import helpers_data
from tests.support import REPO_ROOT

PREPARE_SCRIPT = REPO_ROOT / "scripts" / "prepare_data.py"


@pytest.fixture(scope="module")
def tok_dir(tokenizer_dir):
    return tokenizer_dir


def write_stream(path, tokens, vocab_size=400, num_docs=1):
    """Write a hand-made token stream + sidecar, as prepare_data.py would."""
    dtype = dtype_for_vocab(vocab_size)
    np.asarray(tokens, dtype=dtype).tofile(path)
    write_meta(path, vocab_size=vocab_size, num_tokens=len(tokens), num_docs=num_docs,
               bos_token_id=1, eos_token_id=2, tokenizer="hand-made")
    return path


def test_windows_are_shifted_and_cover_the_stream(tmp_path):
    stream = np.arange(3, 103) % 400  # 100 tokens
    path = write_stream(tmp_path / "s.bin", stream)
    T = 8
    ds = PackedPretrainDataset(path, max_length=T)
    assert len(ds) == (100 - 1) // T == 12
    pieces = []
    for i in range(len(ds)):
        input_ids, labels = ds[i]
        assert input_ids.shape == labels.shape == (T,) and input_ids.dtype == labels.dtype == torch.int64
        assert torch.equal(input_ids[1:], labels[:-1])
        assert (labels != -100).all()
        assert labels.tolist() == stream[i * T + 1:(i + 1) * T + 1].tolist()
        pieces.append(torch.cat([input_ids, labels[-1:]]) if i == 0 else labels)
    # window 0 + every later window's targets = the stream prefix, each token a target exactly once
    assert torch.cat(pieces).tolist() == stream[:len(ds) * T + 1].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_prepare_then_load_agree(tmp_path, tok_dir, tokenizer):
    texts = helpers_data.SAMPLE_TEXTS + ["", "short", None, "a final line"]
    data = helpers_data.write_jsonl(tmp_path / "corpus.jsonl", texts)
    out = tmp_path / "out" / "corpus.bin"
    # two workers and tiny chunks, so results must be put back in order
    stats = prepare(data, out, tok_dir, num_proc=2, chunk_lines=2)
    docs = [t for t in texts if t is not None]
    expected = []
    for text in docs:
        expected += [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids
        expected += [tokenizer.eos_token_id]
    meta = read_meta(out)
    assert meta["num_docs"] == stats["docs"] == len(docs)
    assert meta["num_tokens"] == stats["tokens"] == len(expected)
    assert meta["vocab_size"] == len(tokenizer) and meta["dtype"] == "uint16"
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus.bin", "corpus.bin.json"]
    ds = PackedPretrainDataset(out, max_length=4, vocab_size=len(tokenizer), tokenizer=tokenizer)
    assert ds[0][0].tolist() == expected[:4] and ds[1][1].tolist() == expected[5:9]


def test_vocab_mismatch(tmp_path, tokenizer):
    n = len(tokenizer)
    path = write_stream(tmp_path / "s.bin", np.arange(50), vocab_size=n + 100)
    with pytest.raises(DataError) as info:
        PackedPretrainDataset(path, max_length=8, tokenizer=tokenizer)
    assert "s.bin" in str(info.value) and str(n + 100) in str(info.value) and str(n) in str(info.value)
    with pytest.raises(DataError, match=rf"s\.bin: .*vocab_size {n + 100} .*vocab_size is {n}\b"):
        PackedPretrainDataset(path, max_length=8, vocab_size=n)
    PackedPretrainDataset(path, max_length=8, vocab_size=n + 100)  # a bigger model vocab is fine


def test_truncated_bin(tmp_path):
    path = write_stream(tmp_path / "s.bin", np.arange(50))
    with open(path, "r+b") as f:
        f.truncate(99 - 1)
    with pytest.raises(DataError, match=r"s\.bin: size is 98 bytes .* 50 tokens .* truncated"):
        PackedPretrainDataset(path, max_length=8)


def test_missing_or_corrupt_sidecar(tmp_path):
    path = write_stream(tmp_path / "s.bin", np.arange(50))
    side = tmp_path / "s.bin.json"
    side.write_text("{not json")
    with pytest.raises(DataError, match=r"s\.bin\.json: corrupt metadata"):
        read_meta(path)
    side.unlink()
    with pytest.raises(DataError, match=r"s\.bin\.json: not found .*prepare_data\.py"):
        read_meta(path)
    with pytest.raises(DataError, match=r"other\.bin: not found"):
        read_meta(tmp_path / "other.bin")


def test_too_short_for_one_window(tmp_path):
    path = write_stream(tmp_path / "s.bin", np.arange(8))
    with pytest.raises(DataError, match=r"s\.bin: has 8 tokens, fewer than .* 9"):
        PackedPretrainDataset(path, max_length=8)


def test_uint32_stream_for_big_vocab(tmp_path):
    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"
    stream = np.arange(70000, 70040)
    path = write_stream(tmp_path / "s.bin", stream, vocab_size=80000)
    assert read_meta(path)["dtype"] == "uint32"
    assert PackedPretrainDataset(path, max_length=8)[1][0].tolist() == stream[8:16].tolist()


def test_skip_bad_lines_counts_them(tmp_path, tok_dir):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "one"}\n[1]\n{"text": "two"}\n\n{"txt": "x"}\n{"text": "three"}\n')
    stats = prepare(data, tmp_path / "c.bin", tok_dir, num_proc=1, skip_bad_lines=True, chunk_lines=2)
    assert stats["docs"] == 3
    assert stats["bad_lines"] == 2
    assert [m.split(": ")[0] for m in stats["first_bad"]] == [f"{data}:2", f"{data}:5"]
    assert read_meta(tmp_path / "c.bin")["num_docs"] == 3


@pytest.mark.slow
def test_bad_line_without_flag_exits_2(tmp_path, tok_dir):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n{"text": "four"}\n')
    out = tmp_path / "c.bin"
    result = subprocess.run([sys.executable, str(PREPARE_SCRIPT), "--data_path", str(data),
                             "--out_path", str(out), "--tokenizer_path", str(tok_dir), "--num_proc", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "corpus.jsonl:3: not valid JSON" in result.stderr
    assert list(tmp_path.iterdir()) == [data]  # no half-written output or temp files


def test_packed_through_dataloader_workers(tmp_path):
    path = write_stream(tmp_path / "s.bin", np.arange(200) % 400)
    ds = PackedPretrainDataset(path, max_length=16)
    ds[0]  # open the memmap here; it must not be what the workers get
    expected = torch.stack([ds[i][1] for i in range(len(ds))])
    got = torch.cat([labels for _, labels in DataLoader(ds, batch_size=3, num_workers=2)])
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------- token ids that do not fit
def test_a_token_id_past_the_models_vocab_is_one_line_at_open(tmp_path):
    stream = np.full(500, 7)
    stream[321] = 450  # the sidecar says vocab 6400; the model has 400 ids
    path = write_stream(tmp_path / "s.bin", stream, vocab_size=400)
    with pytest.raises(DataError) as info:
        PackedPretrainDataset(path, max_length=16, vocab_size=400)
    assert str(info.value).startswith(f"{path}: holds token id 450, but the model's vocab_size is 400 (ids 0 to 399)")
    assert PackedPretrainDataset(path, max_length=16, vocab_size=451)  # it fits a larger embedding


@pytest.mark.parametrize("layout", ["manifest", "plain_directory"])
def test_a_token_id_past_the_vocab_in_one_shard_names_that_shard_in_one_line(tmp_path, layout):
    """A shard directory is checked file by file: the line names the shard that holds the id
    (one of many, the one to re-make), not just the directory. Through the trainer, in-process:
    exit code 2 and that one line, no traceback, before any step."""
    from dataset.shards import write_manifest
    from tests.support.assertions import error_lines
    from tests.support.jobs import run_trainer
    from tests.support.run_outputs import out_args
    from tests.support.tiny import TINY

    shards = tmp_path / "shards"
    shards.mkdir()
    bad = np.full(2048, 9)
    bad[1500] = 7000  # the sidecars say vocab 6400, the tokenizer's and the model's
    for name, stream in (("00000-a.bin", np.full(2048, 9)), ("00001-b.bin", bad)):
        write_stream(shards / name, stream, vocab_size=6400)
    if layout == "manifest":  # as prepare_data.py leaves a finished directory
        write_manifest(shards, {"dtype": "uint16", "vocab_size": 6400, "bos_token_id": 1, "eos_token_id": 2,
                                "tokenizer": "hand-made"},
                       [{"path": name, "num_tokens": 2048, "num_docs": 1} for name in ("00000-a.bin", "00001-b.bin")],
                       runs=[])
    message = f"{shards / '00001-b.bin'}: holds token id 7000, but the model's vocab_size is 6400 (ids 0 to 6399)"
    with pytest.raises(DataError) as info:
        ShardedPackedDataset(shards, max_length=16, vocab_size=6400)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    result = run_trainer([*TINY, *out_args(tmp_path / "run"), "--data_path", str(shards), "--max_steps", "2"],
                         tmp_path / "run")
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    lines = error_lines(result.stdout)
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stdout[-3000:]
    assert "step 1/" not in result.stdout  # failed at open, before the first step


def test_an_empty_shard_among_others_is_read_past(tmp_path):
    from dataset.shards import write_manifest

    shards = tmp_path / "shards"
    shards.mkdir()
    names = ("0-a.bin", "1-b.bin", "2-c.bin")
    for name, stream in zip(names, ([1, 5, 6, 2], [], [1, 7, 8, 2])):
        write_stream(shards / name, stream)
    write_manifest(shards, {"dtype": "uint16", "vocab_size": 400, "bos_token_id": 1, "eos_token_id": 2,
                            "tokenizer": "hand-made"},
                   [{"path": name, "num_tokens": n, "num_docs": 1} for name, n in zip(names, (4, 0, 4))], runs=[])
    (shards / "2-c.bin.json").write_text("[]")  # a shard sidecar that is no JSON object: its ids are counted
    ds = ShardedPackedDataset(shards, max_length=3, vocab_size=400)
    assert [ds[i][0].tolist() for i in range(len(ds))] == [[1, 5, 6], [2, 1, 7]]


@pytest.mark.parametrize("key,value", [("vocab_size", "6400"), ("num_docs", -1), ("bos_token_id", True)])
def test_a_manifest_value_that_is_no_count_is_one_line(tmp_path, key, value):
    from dataset.shards import write_manifest

    shards = tmp_path / "shards"
    shards.mkdir()
    write_stream(shards / "0-a.bin", np.full(64, 9), vocab_size=6400)
    common = {"dtype": "uint16", "vocab_size": 6400, "bos_token_id": 1, "eos_token_id": 2, "tokenizer": "hand-made"}
    manifest = write_manifest(shards, common, [{"path": "0-a.bin", "num_tokens": 64, "num_docs": 1}], runs=[])
    (shards / "manifest.json").write_text(json.dumps({**manifest, key: value}))
    with pytest.raises(DataError, match=f"corrupt manifest \\({key} not a non-negative integer\\)"):
        ShardedPackedDataset(shards, max_length=16, vocab_size=6400)


@pytest.mark.parametrize("count", ["64", 64.0, -64])
def test_a_shard_count_that_is_no_count_is_one_line_not_rounded(tmp_path, count):
    from dataset.shards import write_manifest

    shards = tmp_path / "shards"
    shards.mkdir()
    write_stream(shards / "0-a.bin", np.full(64, 9), vocab_size=6400)
    common = {"dtype": "uint16", "vocab_size": 6400, "bos_token_id": 1, "eos_token_id": 2, "tokenizer": "hand-made"}
    manifest = write_manifest(shards, common, [{"path": "0-a.bin", "num_tokens": 64, "num_docs": 1}], runs=[])
    manifest["shards"][0]["num_tokens"] = count  # the total stays a good count: only the shard's is wrong
    (shards / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"corrupt manifest \(0-a\.bin's num_tokens not a non-negative integer\)"):
        ShardedPackedDataset(shards, max_length=16, vocab_size=6400)


def test_the_recorded_largest_id_is_trusted_only_for_the_file_it_was_counted_on(tmp_path):
    from dataset.packed_dataset import largest_token_id

    path = write_stream(tmp_path / "s.bin", np.arange(3, 103))
    meta = json.loads(meta_path(path).read_text())
    assert "max_token_id" not in meta  # a sidecar from before the field (or hand-made): the file is scanned
    assert largest_token_id(path, np.uint16) == 102
    stat = path.stat()
    meta.update(max_token_id=5, bin_bytes=stat.st_size, bin_mtime_ns=stat.st_mtime_ns)  # a (false) record
    meta_path(path).write_text(json.dumps(meta))
    assert largest_token_id(path, np.uint16) == 5  # stamped for this very file: trusted, no scan
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[0] = 399  # edited in place: same size, a new mtime
    tokens.flush()
    del tokens
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert largest_token_id(path, np.uint16) == 399


def test_prepare_data_records_the_largest_id_of_every_file(tmp_path, tok_dir):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of text"}) + "\n" for i in range(20)))
    prepare(corpus, tmp_path / "c.bin", num_proc=1, tokenizer_path=tok_dir)
    meta = json.loads(meta_path(tmp_path / "c.bin").read_text())
    tokens = np.fromfile(tmp_path / "c.bin", dtype=np.uint16)
    assert meta["max_token_id"] == tokens.max() and meta["bin_bytes"] == tokens.nbytes
    prepare(corpus, tmp_path / "shards", num_proc=1, tokenizer_path=tok_dir)
    for shard in (tmp_path / "shards").glob("*.bin"):
        assert json.loads(meta_path(shard).read_text())["max_token_id"] == np.fromfile(shard, dtype=np.uint16).max()
