"""Corpora of many files: inputs as a file, a directory or a glob; Parquet; shard
directories written by one or several machines, resumed after a kill; training reads a
shard directory as one stream, each window once per epoch, with few open files."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from dataset.demo_corpus import DEMO_CORPUS
from common.errors import DataError
from dataset.packed_dataset import PackedPretrainDataset, write_meta
from dataset.shards import MANIFEST, ShardedPackedDataset
from scripts import prepare_data
from scripts.prepare_data import prepare
from tests.support import helpers_data
from tests.support.assertions import assert_bitwise_equal, assert_clean_exit
from tests.support import REPO_ROOT
from tests.support.jobs import run_trainer
from tests.support.run_outputs import checkpoint_name, latest_checkpoint, out_args
from tests.support.tiny import TINY
from tests.support.fault_injection import fault_env
from trainer.data import ResumableDistributedSampler, open_dataset

DEMO = DEMO_CORPUS
TEXTS = helpers_data.SAMPLE_TEXTS * 3  # 15 documents


@pytest.fixture(scope="module")
def tok_dir(tokenizer_dir):
    return tokenizer_dir


def split_corpus(folder, parts=3):
    """TEXTS over `parts` JSONL files (plus a file that is not data), and the same as one file."""
    folder.mkdir()
    for k in range(parts):
        helpers_data.write_jsonl(folder / f"part{k}.jsonl", TEXTS[k::parts])
    (folder / "README.md").write_text("not data\n")
    whole = [t for k in range(parts) for t in TEXTS[k::parts]]
    return helpers_data.write_jsonl(folder.parent / "whole.jsonl", whole)


def shard_bytes(out_dir):
    """The token stream of a shard directory, in manifest order."""
    manifest = json.loads((Path(out_dir) / MANIFEST).read_text())
    return b"".join((Path(out_dir) / s["path"]).read_bytes() for s in manifest["shards"])


def without_runs(out_dir):
    manifest = json.loads((Path(out_dir) / MANIFEST).read_text())
    manifest.pop("runs")
    return manifest


# ---------------------------------------------------------------------------- inputs
def test_glob_and_directory_give_the_tokens_of_the_concatenated_file(tmp_path, tok_dir):
    whole = split_corpus(tmp_path / "data")
    prepare(whole, tmp_path / "whole.bin", tok_dir, num_proc=1)
    prepare(str(tmp_path / "data" / "*.jsonl"), tmp_path / "glob.bin", tok_dir, num_proc=1)
    prepare(str(tmp_path / "data" / "part*"), tmp_path / "by_glob", tok_dir, num_proc=1)
    stats = prepare(tmp_path / "data", tmp_path / "by_dir", tok_dir, num_proc=2, chunk_lines=2)

    expected = (tmp_path / "whole.bin").read_bytes()
    assert (tmp_path / "glob.bin").read_bytes() == expected
    assert shard_bytes(tmp_path / "by_glob") == shard_bytes(tmp_path / "by_dir") == expected
    manifest = stats["manifest"]
    assert [s["path"] for s in manifest["shards"]] == ["00000-part0.bin", "00001-part1.bin", "00002-part2.bin"]
    assert manifest["num_docs"] == len(TEXTS) and manifest["num_tokens"] == len(expected) // 2
    run = manifest["runs"][0]
    assert run["docs"] == len(TEXTS) and run["bad_lines"] == 0 and run["tokens_per_s"] > 0 and run["peak_rss_mb"] > 0
    assert run["cpu_s"] > 0

    # training reads the shard directory as the very windows of the single file
    single, sharded = PackedPretrainDataset(tmp_path / "whole.bin", 16), ShardedPackedDataset(tmp_path / "by_dir", 16)
    assert len(sharded) == len(single) > 3
    for i in range(len(single)):
        assert all(torch.equal(a, b) for a, b in zip(sharded[i], single[i]))


def test_shard_tokens_cuts_at_document_ends(tmp_path, tok_dir):
    split_corpus(tmp_path / "data", parts=1)
    prepare(tmp_path / "data", tmp_path / "one", tok_dir, num_proc=1)
    manifest = prepare(tmp_path / "data", tmp_path / "cut", tok_dir, num_proc=1, shard_tokens=40)["manifest"]
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "one")
    shards = manifest["shards"]
    assert len(shards) > 2 and all(s["num_tokens"] >= 40 for s in shards[:-1])
    eos = json.loads((tmp_path / "cut" / MANIFEST).read_text())["eos_token_id"]
    for s in shards:
        tokens = np.fromfile(tmp_path / "cut" / s["path"], dtype=np.uint16)
        assert tokens[-1] == eos and (tokens == eos).sum() == s["num_docs"]


def test_two_machines_make_the_manifest_of_one(tmp_path, tok_dir):
    data = tmp_path / "data"
    data.mkdir()
    for k in range(5):
        helpers_data.write_jsonl(data / f"f{k}.jsonl", TEXTS[k:k + 4])
    prepare(data, tmp_path / "one", tok_dir, num_proc=1)
    first = prepare(data, tmp_path / "two", tok_dir, num_proc=1, num_shards=2, shard_index=0)
    assert first["manifest"] is None and not (tmp_path / "two" / MANIFEST).exists()
    assert sorted(p.name for p in (tmp_path / "two").glob("*.bin")) == ["00000-f0.bin", "00002-f2.bin", "00004-f4.bin"]
    second = prepare(data, tmp_path / "two", tok_dir, num_proc=1, num_shards=2, shard_index=1)
    assert second["inputs"] == 2 and second["manifest"] is not None
    assert without_runs(tmp_path / "two") == without_runs(tmp_path / "one")
    assert shard_bytes(tmp_path / "two") == shard_bytes(tmp_path / "one")
    runs = json.loads((tmp_path / "two" / MANIFEST).read_text())["runs"]
    assert [(r["shard_index"], r["num_shards"], r["inputs"]) for r in runs] == [(0, 2, 3), (1, 2, 2)]


def test_a_directory_made_from_other_inputs_is_refused(tmp_path, tok_dir):
    split_corpus(tmp_path / "data")
    prepare(tmp_path / "data", tmp_path / "out", tok_dir, num_proc=1)
    with pytest.raises(DataError, match="holds shards made with other inputs"):
        prepare(tmp_path / "data" / "part0.jsonl", tmp_path / "out", tok_dir, num_proc=1)


def test_a_directory_made_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, tok_dir):
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tok_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"][0]["lstrip"] = not spec["added_tokens"][0]["lstrip"]  # same size, other tokens
    (other / "tokenizer.json").write_text(json.dumps(spec))
    split_corpus(tmp_path / "data")
    prepare(tmp_path / "data", tmp_path / "out", tok_dir, num_proc=1, num_shards=3, shard_index=0)
    with pytest.raises(DataError, match="holds shards made with other tokenizer_sha256"):
        prepare(tmp_path / "data", tmp_path / "out", other, num_proc=1, num_shards=3, shard_index=1)


# ---------------------------------------------------------------------------- Parquet
def write_parquet(path, values, row_group_size=2):
    table = pa.table({"id": list(range(len(values))), "content": values})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_parquet_gives_the_bin_of_the_same_rows_as_jsonl(tmp_path, tok_dir):
    write_parquet(tmp_path / "rows.parquet", TEXTS)
    helpers_data.write_jsonl(tmp_path / "rows.jsonl", TEXTS)
    prepare(tmp_path / "rows.parquet", tmp_path / "p.bin", tok_dir, num_proc=2, text_column="content", chunk_lines=4)
    prepare(tmp_path / "rows.jsonl", tmp_path / "j.bin", tok_dir, num_proc=1)
    assert (tmp_path / "p.bin").read_bytes() == (tmp_path / "j.bin").read_bytes()
    sidecars = [json.loads((tmp_path / name).read_text()) for name in ("p.bin.json", "j.bin.json")]
    for sidecar in sidecars:  # when each file was written differs; everything else is the same
        del sidecar["bin_mtime_ns"]
    assert sidecars[0] == sidecars[1]
    # and the two kinds mix in one directory, each file its own shard
    mixed = prepare(str(tmp_path / "rows.*"), tmp_path / "mixed", tok_dir, num_proc=1, text_column="content")
    assert mixed["manifest"]["num_docs"] == 2 * len(TEXTS)


def test_null_text_in_parquet_is_a_bad_row(tmp_path, tok_dir):
    path = write_parquet(tmp_path / "rows.parquet", ["one", "two", None, "four", "five"])
    with pytest.raises(DataError) as caught:
        prepare(path, tmp_path / "o.bin", tok_dir, num_proc=1, text_column="content")
    assert str(caught.value).startswith(f"{path}: row group 1, row 0: column 'content' is null")
    stats = prepare(path, tmp_path / "o.bin", tok_dir, num_proc=1, text_column="content", skip_bad_lines=True)
    assert stats["docs"] == 4 and stats["bad_lines"] == 1


def run_cli(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["prepare_data.py", *map(str, argv)])
    with pytest.raises(SystemExit) as caught:
        prepare_data.main()
    return caught.value.code, capsys.readouterr().err.strip().splitlines()


def test_each_bad_input_gets_one_line(tmp_path, tok_dir, monkeypatch, capsys):
    out = ["--out_path", tmp_path / "out", "--tokenizer_path", tok_dir, "--num_proc", "1"]
    pattern = tmp_path / "nothing" / "*.jsonl"
    assert run_cli(monkeypatch, capsys, "--data_path", pattern, *out) == (
        2, [f"error: --data_path {pattern}: the pattern matches no .jsonl or .parquet file; check it, and quote "
            f"it so that the shell does not expand it"])
    write_parquet(tmp_path / "rows.parquet", ["one", "two"])
    assert run_cli(monkeypatch, capsys, "--data_path", tmp_path / "rows.parquet", *out) == (
        2, [f"error: {tmp_path / 'rows.parquet'}: no column 'text' (columns: id, content); pass --text_column "
            f"with the one that holds the text"])
    write_parquet(tmp_path / "rows.parquet", ["one", None])
    rc, lines = run_cli(monkeypatch, capsys, "--data_path", tmp_path / "rows.parquet", "--text_column", "content", *out)
    assert rc == 2 and len(lines) == 1 and "rows.parquet: row group 0, row 1: column 'content' is null" in lines[0]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.bin*"))
    (tmp_path / "empty").mkdir()
    assert run_cli(monkeypatch, capsys, "--data_path", tmp_path / "empty", *out) == (
        2, [f"error: --data_path {tmp_path / 'empty'}: directory has no .jsonl or .parquet file; pass a directory, "
            f"file or quoted glob of .jsonl or .parquet files"])
    # the trainer names an empty pattern the same way
    with pytest.raises(DataError, match=r"the pattern matches no \.bin or \.jsonl or \.parquet file"):
        open_dataset(str(pattern), "--data_path", None, 16, 6400)


def test_the_trainer_reads_a_directory_of_jsonl_files_one_after_the_other(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    whole = split_corpus(tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    many = open_dataset(str(tmp_path / "data"), "--data_path", tokenizer, 32, 6400)
    one = open_dataset(str(whole), "--data_path", tokenizer, 32, 6400)
    assert len(many) == len(one) == len(TEXTS)
    assert all(torch.equal(many[i][0], one[i][0]) for i in range(len(one)))


# ---------------------------------------------------------------------------- a killed prep resumes
@pytest.mark.slow
def test_a_killed_prep_resumes_and_skips_complete_shards(tmp_path, tok_dir):
    data = tmp_path / "data"
    data.mkdir()
    lines = DEMO.read_text().splitlines(keepends=True)
    for k in range(5):  # each about a second of tokenizing: the kill lands between two files
        (data / f"f{k}.jsonl").write_text("".join(lines[k * 300:(k + 1) * 300]))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "prepare_data.py"), "--data_path", str(data),
           "--out_path", str(tmp_path / "out"), "--tokenizer_path", str(tok_dir), "--num_proc", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = tmp_path / "out" / ".prep" / "input-00000.json"
    deadline = time.monotonic() + 120
    while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out" / MANIFEST).exists(), "the run finished before the kill; use bigger inputs"
    done = len(list((tmp_path / "out" / ".prep").glob("input-*.json")))
    assert 1 <= done < 5

    resumed = prepare(data, tmp_path / "out", tok_dir, num_proc=1)
    assert resumed["inputs_skipped"] == done and resumed["inputs"] == 5 - done
    assert not list((tmp_path / "out").glob("*.tmp*")), "what the killed run left was cleared"
    prepare(data, tmp_path / "clean", tok_dir, num_proc=1)
    assert without_runs(tmp_path / "out") == without_runs(tmp_path / "clean")
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")
    again = prepare(data, tmp_path / "out", tok_dir, num_proc=1)
    assert again["inputs"] == 0 and again["inputs_skipped"] == 5 and again["manifest"] is not None


# ---------------------------------------------------------------------------- training reads shards
def hand_made_shards(folder, sizes):
    """Shards whose stream is 0, 1, 2, ...: a window's first token says where it starts."""
    folder.mkdir()
    start = 0
    for k, n in enumerate(sizes):
        path = folder / f"s{k:03d}.bin"
        np.arange(start, start + n, dtype=np.uint32).tofile(path)
        write_meta(path, vocab_size=100_000, num_tokens=n, num_docs=1, bos_token_id=1, eos_token_id=2,
                   tokenizer="hand-made")
        start += n
    return folder, start


def test_two_ranks_read_every_window_once_per_epoch(tmp_path):
    folder, total = hand_made_shards(tmp_path / "shards", [50, 7, 3, 90, 31, 64, 20])  # windows span 3 shards
    T, batch, world = 8, 3, 2
    ds = ShardedPackedDataset(folder, T)
    assert len(ds) == (total - 1) // T
    steps = len(ds) // (batch * world)
    for epoch in (0, 1):
        starts = []
        for rank in range(world):
            sampler = ResumableDistributedSampler(ds, world, rank, seed=7)
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2)
            for step, (x, y) in enumerate(loader):
                if step == steps:
                    break
                assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
                assert torch.equal(x, x[:, :1] + torch.arange(T))  # consecutive across shard ends
                starts += x[:, 0].tolist()
        assert len(starts) == len(set(starts)) == steps * batch * world
        assert all(s % T == 0 and s // T < len(ds) for s in starts)


def mapped_shards(folder):
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if str(folder) in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_thousand_shards_do_not_mean_a_thousand_open_files(tmp_path):
    folder, _ = hand_made_shards(tmp_path / "shards", [10] * 40)
    ds = ShardedPackedDataset(folder, 4, max_open=4)
    assert mapped_shards(folder) == set(), "nothing is opened before it is read"
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(len(ds)):
        ds[i]
        assert len(mapped_shards(folder)) <= 4 and len(ds._open) <= 4
    assert len(os.listdir("/proc/self/fd")) <= fds + 4
    assert pickle.loads(pickle.dumps(ds))._open == {}, "a worker gets paths, not maps"


def test_an_unfinished_prep_directory_is_refused(tmp_path, tok_dir):
    data = tmp_path / "data"
    split_corpus(data)
    prepare(data, tmp_path / "out", tok_dir, num_proc=1, num_shards=2, shard_index=0)
    with pytest.raises(DataError, match="prepare_data.py has not finished here"):
        ShardedPackedDataset(tmp_path / "out", 4)


# ---------------------------------------------------------------------------- the real trainer, 2 processes
@pytest.mark.slow
def test_training_on_shards_resumes_bitwise_as_on_the_concatenated_file(tmp_path, tok_dir):
    """2 processes on the single .bin made from the concatenated inputs; 2 processes on
    the shard directory, one rank SIGKILLed at step 4, then resumed from step 3 (the
    ranks forked from the preloaded trainer: tests/support/forked_ranks.py). Same windows, same
    final weights."""
    lines = DEMO.read_text().splitlines(keepends=True)[:300]
    (tmp_path / "data").mkdir()
    for k in range(3):
        (tmp_path / "data" / f"part{k}.jsonl").write_text("".join(lines[k * 100:(k + 1) * 100]))
    (tmp_path / "whole.jsonl").write_text("".join(lines))
    prepare(tmp_path / "whole.jsonl", tmp_path / "whole.bin", tok_dir, num_proc=1)
    prepare(str(tmp_path / "data" / "*.jsonl"), tmp_path / "shards", tok_dir, num_proc=1, shard_tokens=5000)

    base = [*TINY, "--max_steps", "6", "--save_interval", "3", "--global_batch_size", "8", "--num_workers", "1"]
    straight = run_trainer([*base, "--data_path", str(tmp_path / "whole.bin"), *out_args(tmp_path / "straight")],
                           tmp_path / "straight", nproc=2, mode="forked")
    assert_clean_exit(straight.returncode, straight.stdout, "straight")
    shard_args = [*base, "--data_path", str(tmp_path / "shards"), *out_args(tmp_path / "resumed")]
    kill_at_4 = fault_env("kill", at=4, rank=1)
    killed = run_trainer(shard_args, tmp_path / "resumed", nproc=2, mode="forked", env=kill_at_4)
    assert killed.returncode != 0 and "[fault injection] rank 1 SIGKILLs itself at step 4" in killed.stdout
    resumed = run_trainer([*shard_args, "--from_resume", "1"], tmp_path / "resumed", nproc=2, mode="forked")
    assert_clean_exit(resumed.returncode, resumed.stdout, "resumed")
    assert f"{checkpoint_name(3)} at step 3/6" in resumed.stdout
    on_file, on_shards = latest_checkpoint(tmp_path / "straight"), latest_checkpoint(tmp_path / "resumed")
    assert on_file["global_step"] == on_shards["global_step"] == 6
    assert_bitwise_equal(on_file["model"], on_shards["model"])


def test_shards_of_two_tokenizers_are_refused(tmp_path):
    folder, _ = hand_made_shards(tmp_path / "shards", [20, 20])
    meta = json.loads((folder / "s001.bin.json").read_text())
    (folder / "s001.bin.json").write_text(json.dumps(dict(meta, eos_token_id=3)))
    with pytest.raises(DataError, match=r"s001\.bin: eos_token_id 3 differs from 2 in s000\.bin"):
        ShardedPackedDataset(folder, 4)
    for name, identity in (("s000", "a" * 64), ("s001", "b" * 64)):  # and one tokenizer's twin of the same size
        meta = json.loads((folder / f"{name}.bin.json").read_text())
        (folder / f"{name}.bin.json").write_text(json.dumps(dict(meta, eos_token_id=2, tokenizer_sha256=identity)))
    with pytest.raises(DataError, match=r"s001\.bin: tokenizer_sha256 b+ differs from a+ in s000\.bin"):
        ShardedPackedDataset(folder, 4)


def test_a_truncated_shard_is_named_and_redone_by_a_rerun(tmp_path, tok_dir):
    split_corpus(tmp_path / "data")
    prepare(tmp_path / "data", tmp_path / "out", tok_dir, num_proc=1)
    shard = tmp_path / "out" / "00001-part1.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"00001-part1\.bin: \d+ bytes, but manifest\.json says"):
        ShardedPackedDataset(tmp_path / "out", 4)
    again = prepare(tmp_path / "data", tmp_path / "out", tok_dir, num_proc=1)
    assert again["inputs"] == 1 and again["inputs_skipped"] == 2
    assert len(ShardedPackedDataset(tmp_path / "out", 4)) > 0
