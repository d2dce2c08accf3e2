"""A full or failing disk costs the scripts one line, never a half file (docs/fault-tolerance.md):
prepare_data.py, the demo corpus, split_corpus.py, a tokenizer and an export each write under
temp names and rename only when every file of the output is on disk; a refused write is one line
naming what, where, why and the free space, and rc 2. The trainer's writes are
tests/test_storage.py's."""
import errno
import json
import os
import re

import pytest

from common.errors import StorageError
from tests.support.fault_injection import MiB, size_of


# ---------------------------------------------------------------------------- prepare_data.py
def run_script(main, argv, disk, capsys) -> tuple[int, str]:
    """A script's main(argv) in this process, the disk's quota (if it has one) on: (exit code, stderr)."""
    capsys.readouterr()
    code = 0
    with disk.installed():
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("layout", ["file", "shards", "sft"])
def test_prepare_data_on_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, small_disk, layout, capsys):
    """One .bin, a shard directory (a shard per 20,000 tokens), or packed conversations (tokens and
    blocks): the disk refuses them half way; one line naming the file, rc 2, no half file; with the
    space back, the same command writes what a roomy disk gets, byte for byte (shards already
    finished are kept, not redone)."""
    from scripts.prepare_data import main
    from tests.support.helpers_data import write_conversations
    from tests.support.tiny import ensure_demo_corpus

    corpus = write_conversations(tmp_path / "chats.jsonl", 400) if layout == "sft" else ensure_demo_corpus()
    name, extra = {"file": ("tokens.bin", []), "shards": ("shards", ["--shard_tokens", "20000"]),
                   "sft": ("chats.bin", ["--sft"])}[layout]
    argv = lambda out_dir: ["--data_path", str(corpus), "--out_path", str(out_dir / name), "--num_proc", "1",  # noqa: E731
                            *extra]
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    main(argv(roomy))
    disk = small_disk(4 * MiB)
    disk.fill(leave=size_of(roomy / name) // 2)
    code, err = run_script(main, argv(disk.path), disk, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    what = {"file": "the packed tokens", "shards": "the shard", "sft": "the packed (tokens|conversations' blocks)"}
    assert re.match(rf"error: cannot write {what[layout]} {re.escape(str(disk.path / name))}\S*: no space left on "
                    rf"device \(.* free there\); free space there or pass another --out_path, then run it again",
                    line), line
    assert not [p for p in disk.path.rglob("*") if ".tmp" in p.name]
    if layout != "shards":  # a directory of shards keeps the inputs it finished
        assert sorted(p.name for p in disk.path.iterdir()) == ["ballast"]
    disk.empty()
    assert run_script(main, argv(disk.path), disk, capsys)[0] == 0
    made = sorted(p.relative_to(roomy) for p in roomy.rglob("*") if p.suffix in (".bin", ".blocks"))
    assert made == sorted(p.relative_to(disk.path) for p in disk.path.rglob("*") if p.suffix in (".bin", ".blocks"))
    for path in made:
        assert (roomy / path).read_bytes() == (disk.path / path).read_bytes(), path
    if layout == "shards":
        manifest = json.loads((disk.path / name / "manifest.json").read_text())
        assert manifest["num_tokens"] == json.loads((roomy / name / "manifest.json").read_text())["num_tokens"]


def fsync_fails_for(monkeypatch, suffix: str):
    """fsync refuses the files whose name ends in `suffix` (EIO), as a disk that reports a lost
    write only when it is asked to make the bytes durable."""
    import common.storage

    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(suffix):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)
    monkeypatch.setattr(common.storage.os, "fsync", fsync)


def test_an_output_whose_last_file_fails_leaves_none_of_its_files_in_place(tmp_path, monkeypatch):
    """Packed conversations are three files (tokens, blocks, sidecar) written under temp names: the
    sidecar, written last, fails at its fsync, and neither the tokens nor the blocks (already on
    disk) are renamed into place."""
    from scripts.prepare_data import prepare_sft
    from tests.support.helpers_data import write_conversations

    out = tmp_path / "out" / "chats.bin"
    fsync_fails_for(monkeypatch, ".bin.json.tmp")
    with pytest.raises(StorageError) as info:
        prepare_sft(write_conversations(tmp_path / "chats.jsonl"), out, num_proc=1)
    assert re.fullmatch(rf"cannot write the packed tokens' metadata {out}.json: input/output error \(.*\); check "
                        rf"that disk and its mount, or pass another --out_path, then run it again .*", str(info.value))
    assert list(out.parent.iterdir()) == []


# ---------------------------------------------------------------------------- the demo corpus and its split
def test_the_demo_corpus_on_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, small_disk, capsys):
    from scripts.build_demo_corpus import main

    argv = lambda out: ["--modules", "json,textwrap", "--out", str(out), "--jobs", "1"]  # noqa: E731
    main(argv(tmp_path / "roomy.jsonl"))
    disk = small_disk(MiB)
    old = disk.path / "corpus.jsonl"
    old.write_text('{"text": "the corpus built before"}\n')
    disk.fill(leave=(tmp_path / "roomy.jsonl").stat().st_size // 2)
    code, err = run_script(main, argv(old), disk, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    assert re.fullmatch(rf"error: cannot write the demo corpus {old}: no space left on device \(.* free there\); free "
                        rf"space there or build it elsewhere \(scripts/build_demo_corpus.py --out\)", line), line
    assert sorted(p.name for p in disk.path.iterdir()) == ["ballast", "corpus.jsonl"]
    assert old.read_text() == '{"text": "the corpus built before"}\n'


def test_split_corpus_on_a_full_disk_is_one_line_and_writes_neither_file(tmp_path, small_disk, capsys):
    from scripts.split_corpus import main
    from tests.support.tiny import ensure_demo_corpus

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(ensure_demo_corpus().read_text().splitlines(keepends=True)[:300]))
    argv = lambda out: ["--data_path", str(corpus), "--train_out", str(out / "train.jsonl"),  # noqa: E731
                        "--val_out", str(out / "val.jsonl"), "--every", "5"]
    disk = small_disk(MiB)
    disk.fill(leave=corpus.stat().st_size // 2)
    code, err = run_script(main, argv(disk.path), disk, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    assert re.fullmatch(rf"error: cannot write the (training|held-out) documents {disk.path}/(train|val).jsonl: no "
                        rf"space left on device \(.* free there\); free space there or pass another --(train|val)_out",
                        line), line
    assert sorted(p.name for p in disk.path.iterdir()) == ["ballast"]
    disk.empty()
    assert run_script(main, argv(disk.path), disk, capsys)[0] == 0
    roomy = tmp_path / "roomy"
    main(argv(roomy))
    for name in ("train.jsonl", "val.jsonl"):
        assert (disk.path / name).read_bytes() == (roomy / name).read_bytes()


def test_split_corpus_renames_neither_file_until_both_are_on_disk(tmp_path, monkeypatch):
    from scripts.split_corpus import split_corpus

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(20)))
    fsync_fails_for(monkeypatch, "val.jsonl.tmp")
    with pytest.raises(StorageError, match=rf"^cannot write the held-out documents {tmp_path}/out/val.jsonl: input/"):
        split_corpus(corpus, tmp_path / "out" / "train.jsonl", tmp_path / "out" / "val.jsonl", every=5)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_tokenizer_on_a_full_disk_is_one_line_and_keeps_the_one_before(tmp_path, small_disk, capsys):
    from tests.support.tiny import ensure_demo_corpus
    from trainer.train_tokenizer import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(ensure_demo_corpus().read_text().splitlines(keepends=True)[:300]))
    argv = lambda out: ["--data_path", str(corpus), "--vocab_size", "400", "--out_dir", str(out),  # noqa: E731
                        "--no_progress"]
    main(argv(tmp_path / "roomy"))
    disk = small_disk(MiB)
    before = disk.path / "tokenizer"
    before.mkdir()
    (before / "tokenizer.json").write_text("the tokenizer trained before")
    disk.fill(leave=(tmp_path / "roomy" / "tokenizer.json").stat().st_size // 2)
    code, err = run_script(main, argv(before), disk, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    assert re.fullmatch(rf"error: cannot write the tokenizer file {before}/tokenizer.json: no space left on device "
                        rf"\([\d.,]+ KiB free there, [\d.,]+ KiB needed\); free space there or pass another --out_dir",
                        line), line
    assert [p.name for p in before.iterdir()] == ["tokenizer.json"]
    assert (before / "tokenizer.json").read_text() == "the tokenizer trained before"


def test_a_tokenizer_renames_none_of_its_files_until_all_are_on_disk(tmp_path, monkeypatch):
    from trainer.train_tokenizer import save, train

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} of words"}}\n' for i in range(50)))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("the tokenizer trained before")
    fsync_fails_for(monkeypatch, "tokenizer_config.json.tmp")  # the last of the three
    with pytest.raises(StorageError, match=rf"^cannot write the tokenizer file {tmp_path}/out/tokenizer_config.json: "):
        save(train(corpus, 300, progress=False), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tokenizer.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "the tokenizer trained before"


# ---------------------------------------------------------------------------- the Hugging Face export
def test_an_export_that_does_not_fit_is_one_line_and_leaves_no_half_folder(tmp_path, small_disk, capsys):
    """convert_model.py writes and verifies the export beside --out_dir and moves it in whole: a
    disk that fills half way leaves neither a half export nor the folder it was written in."""
    from scripts.convert_model import main
    from tests.support.tiny import train_tiny
    from model.weights import write_weights

    weights = tmp_path / "tiny.pth"
    tiny = train_tiny(use_moe=False)
    write_weights(tiny.state_dict(), tiny.config, str(weights))
    disk = small_disk(4 * MiB)
    disk.fill(leave=MiB)  # the fp32 export of the tiny model takes about 2 MiB
    argv = ["--weight_path", str(weights), "--out_dir", str(disk.path / "hf")]
    code, err = run_script(main, argv, disk, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: cannot write the Hugging Face export {disk.path / 'hf'}: no space left on device")
    assert sorted(p.name for p in disk.path.iterdir()) == ["ballast"]
    disk.empty()
    capsys.readouterr()
    assert run_script(main, argv, disk, capsys)[0] == 0
    assert (disk.path / "hf" / "model.safetensors").is_file()
