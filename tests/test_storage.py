"""A full or failing disk costs one line, never a run (docs/fault-tolerance.md): every write of
the trainer and the scripts that the disk refuses becomes one line naming what, where, why and
the free space; a failed save leaves nothing behind and stops the run; after the space returns
the resume is bitwise the uninterrupted run; start-up removes what a killed save left and warns
of a disk too small; a checkpoint the disk cannot read is skipped like a corrupt one.

The disk is tests/support/fault_injection.py's SmallDisk: a tmpfs where the tests may mount one, else
a folder whose writes a quota refuses past its size."""
import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.errors import StorageError
from common.storage import atomic_torch_save
from tests.support.assertions import assert_bitwise_equal, assert_same_state, error_lines, worker_tracebacks
from tests.support.fault_injection import SmallDisk
from tests.support.jobs import run_trainer
from tests.support.run_outputs import PREFIX, checkpoint_name, latest_link_name, load_checkpoint, out_args
from tests.support.tiny import TINY
from trainer.checkpoint import verify_checkpoint

MiB = 1 << 20
RUN = [*TINY, "--max_steps", "6", "--save_interval", "2"]


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def make(size: int, name: str = "disk") -> SmallDisk:
        disks.append(SmallDisk(tmp_path / name, size))
        return disks[-1]
    yield make
    for disk in disks:
        disk.close()


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size


def final_state(checkpoint_dir: Path, step: int, sharded=False, prefix=PREFIX) -> dict:
    path = checkpoint_dir / checkpoint_name(step, prefix, sharded)
    if sharded:
        dcp_to_torch_save(path, checkpoint_dir.parent / "whole.pt")
        path = checkpoint_dir.parent / "whole.pt"
    return load_checkpoint(path)


def assert_same_run(a: dict, b: dict):
    assert_bitwise_equal(a["model"], b["model"])
    assert_same_state(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer state")


# ---------------------------------------------------------------------------- one write
def test_a_write_the_disk_refuses_is_one_line_and_leaves_the_old_file(small_disk):
    disk = small_disk(4 * MiB)
    target = disk.path / "weights.pth"
    atomic_torch_save({"w": torch.zeros(1000)}, target)
    before = target.read_bytes()
    disk.fill(leave=MiB // 2)
    with pytest.raises(StorageError) as info, disk.installed():
        atomic_torch_save({"w": torch.zeros(MiB)}, target, "the weights", "pass another folder")  # 4 MiB
    line = str(info.value)
    assert re.fullmatch(rf"cannot write the weights {target}: no space left on device \([\d.,]+ KiB free there, "
                        rf"4\.0 MiB needed\); free space there or pass another folder", line), line
    assert target.read_bytes() == before and sorted(p.name for p in disk.path.iterdir()) == ["ballast", "weights.pth"]


def test_the_metrics_file_on_a_full_disk_costs_a_warning_not_the_run(tmp_path, small_disk, capsys):
    """The metrics file only repeats the log lines: a disk that refuses it is said once, and the
    run goes on (a save to that disk would stop it: the next test)."""
    from trainer.loop import TrainClock
    from trainer.metrics import RunLogger
    from trainer.train_state import StepPlan, TrainState

    disk = small_disk(MiB)
    state = TrainState(StepPlan(4, 1, 1, 100, 100))
    output = type("Output", (), {"save_dir": str(disk.path), "from_resume": 0, "use_wandb": False})
    with disk.installed():
        log = RunLogger(str(disk.path / "metrics.jsonl"), output, PREFIX, state, {}, True, TrainClock())
        disk.fill(leave=0)
        for step in (1, 2):
            log.log_train(step, 0, {"loss": 5.0, "aux_loss": 0.0}, {"decay": 1e-3}, 100 * step, 1000.0, 900.0, None)
    out = capsys.readouterr().out
    assert out.count("warning: cannot write the metrics") == 1 and "training goes on" in out
    assert out.count("epoch 1/1 step") == 2  # the log lines, every one


# ---------------------------------------------------------------------------- a run whose disk fills
def disk_run(tmp_path, disk, flags, nproc=1, mode="inprocess", sharded=False, script=None, prefix=PREFIX,
             ref_mode=None):
    """A reference run on a roomy disk (launched as `ref_mode`, else `mode`), then the same run with
    --checkpoint_dir on `disk`, left with room for one and a half checkpoints: the save at step 2
    fits, the one at step 4 does not. Returns (the reference's final state, the failed run, its
    flags of where, the script's)."""
    extra = {"script": script} if script else {}
    ref = run_trainer([*flags, *out_args(tmp_path / "ref")], tmp_path / "ref", nproc=nproc, mode=ref_mode or mode,
                      **extra)
    assert ref.returncode == 0, ref.stdout[-3000:]
    size = size_of(tmp_path / "ref" / "ckpt" / checkpoint_name(2, prefix, sharded))
    disk.fill(leave=int(1.5 * size))
    where = ["--save_dir", str(tmp_path / "run" / "out"), "--checkpoint_dir", str(disk.path)]
    full = run_trainer([*flags, *where], tmp_path / "run", nproc=nproc, mode=mode, env=disk.env, **extra)
    return final_state(tmp_path / "ref" / "ckpt", 6, sharded, prefix), full, where, extra


def assert_stopped_in_one_line_with_step_2_intact(full, disk, sharded=False, prefix=PREFIX):
    assert full.returncode not in (0, None), full.stdout[-3000:]
    lines = error_lines(full.stdout)
    assert lines and all(line == lines[0] for line in lines), lines  # every rank that speaks says the same
    assert re.match(rf"error: cannot write the checkpoint('s shards)? {disk.path}/{prefix}_resume_step0000004\.", lines[0])
    assert "no space left on device" in lines[0] and "free there" in lines[0] and "--from_resume 1" in lines[0]
    assert not worker_tracebacks(full.stdout), worker_tracebacks(full.stdout)[0]  # torchrun's own report aside
    step2 = checkpoint_name(2, prefix, sharded)
    assert sorted(p.name for p in disk.path.iterdir()) == sorted(["ballast", step2, f"{step2}.json",
                                                                   latest_link_name(prefix, sharded)])
    assert os.readlink(disk.path / latest_link_name(prefix, sharded)) == step2
    verify_checkpoint(str(disk.path / step2))


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["one process", "torchrun", "fsdp", "sft"])
def test_a_disk_that_fills_stops_the_run_in_one_line_and_the_resume_is_bitwise(tmp_path, small_disk, launch):
    """One process, 2 DDP processes under torchrun (whose failure report names our line), 2 FSDP
    processes (every rank's shards in a .dcp folder), and fine-tuning: the save at step 4 does
    not fit, the run stops with one line, step 2's checkpoint and link stay as they were; with
    the space back, --from_resume 1 ends bitwise where the uninterrupted run ends."""
    nproc, mode, flags, script, sharded, prefix = 1, "inprocess", RUN, None, False, PREFIX
    ref_mode = None
    if launch == "torchrun":  # the disk fills under the real torchrun; the rest forked, which trains the same bits
        nproc, mode, ref_mode = 2, "torchrun", "forked"
    elif launch == "fsdp":
        nproc, mode, flags, sharded = 2, "forked", [*RUN, "--parallel", "fsdp"], True
    elif launch == "sft":
        from scripts.dev.launching import TRAIN_SFT

        flags, script, prefix = [*RUN, "--from_weight", "none", "--max_seq_len", "128"], TRAIN_SFT, "full_sft_64"
    disk = small_disk(40 * MiB)
    reference, full, where, extra = disk_run(tmp_path, disk, flags, nproc, mode, sharded, script, prefix, ref_mode)
    assert_stopped_in_one_line_with_step_2_intact(full, disk, sharded, prefix)
    if launch == "one process":
        assert re.search(r"warning: --checkpoint_dir \S+ has [\d.,]+ \w+ free .* needs about [\d.,]+ \w+", full.stdout)
    if launch == "torchrun":  # torchrun's own report names the root cause in our words, not a traceback
        assert re.search(r"(?m)^\s*traceback\s*: error: cannot write the checkpoint", full.stdout), full.stdout[-2000:]
    disk.empty()
    resumed = run_trainer([*flags, *where, "--from_resume", "1"], tmp_path / "run", nproc=nproc,
                          mode=ref_mode or mode, env=disk.env, **extra)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2/6" in resumed.stdout
    assert_same_run(final_state(disk.path, 6, sharded, prefix), reference)


@pytest.mark.slow
def test_a_full_disk_under_the_weights_stops_the_save_and_keeps_the_checkpoint_before(tmp_path, small_disk):
    """--save_dir on the small disk: the inference weights of step 4 do not fit; the checkpoint of
    step 4 that was written goes again, and step 2's is the newest."""
    disk = small_disk(16 * MiB)
    ckpt = tmp_path / "ckpt"
    first = run_trainer([*RUN, "--max_steps", "2", "--save_dir", str(disk.path), "--checkpoint_dir", str(ckpt)],
                        tmp_path, env=disk.env)
    assert first.returncode == 0, first.stdout[-3000:]
    disk.fill(leave=size_of(disk.path / f"{PREFIX}.pth") // 2)
    full = run_trainer([*RUN, "--save_dir", str(disk.path), "--checkpoint_dir", str(ckpt), "--from_resume", "1"],
                       tmp_path, env=disk.env)
    assert full.returncode == 2 and "Traceback" not in full.stdout, full.stdout[-3000:]
    [line] = error_lines(full.stdout)
    assert line.startswith(f"error: cannot write the weights {disk.path}/{PREFIX}.pth: no space left on device")
    assert sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".pth")) == sorted([checkpoint_name(2),
                                                                                          latest_link_name()])
    assert not [p for p in disk.path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------- start-up and reads
def test_start_up_removes_what_a_killed_save_left_and_only_this_runs(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    leftovers = [ckpt / f"{checkpoint_name(4)}.tmp", ckpt / f"{checkpoint_name(4)}.json.tmp",
                 ckpt / f"{latest_link_name()}.tmp", out / f"{PREFIX}.pth.tmp"]
    (ckpt / f"{checkpoint_name(4, sharded=True)}.tmp").mkdir()  # a half .dcp folder
    leftovers.append(ckpt / f"{checkpoint_name(4, sharded=True)}.tmp")
    other_run = ckpt / "pretrain_128_resume_step0000004.pth.tmp"  # another run's save, maybe under way
    for path in [*leftovers[:-1], other_run]:
        path.write_bytes(b"half")
    run = run_trainer([*TINY, "--max_steps", "1", *out_args(tmp_path)], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    for path in leftovers:
        assert not path.exists() and f"removed {path}, left by a save that did not finish" in run.stdout
    assert other_run.exists()


def test_a_newest_checkpoint_the_disk_cannot_read_gives_way_to_the_one_before(tmp_path, monkeypatch):
    import builtins

    first = run_trainer([*RUN, "--max_steps", "4", *out_args(tmp_path)], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    unreadable = str(tmp_path / "ckpt" / checkpoint_name(4))
    real_open = builtins.open

    def failing_open(file, *args, **kwargs):
        if str(file) == unreadable:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", failing_open)
    resumed = run_trainer([*RUN, *out_args(tmp_path), "--from_resume", "1"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("skipping checkpoint")]
    assert skipped == [f"skipping checkpoint {unreadable}: cannot be read (Input/output error)"]
    assert f"resumed from {tmp_path / 'ckpt' / checkpoint_name(2)} at step 2/6" in resumed.stdout


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
