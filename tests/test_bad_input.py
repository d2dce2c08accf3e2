"""Bad data and bad flags cost one line, not a run: a message naming the flag, file or
line, printed once (by rank 0), a non-zero exit, no hang, no Python traceback, and the
checkpoints already in --checkpoint_dir left byte for byte as they were.

Every case runs train_pretrain.main() in-process, end to end from the flags to the exit
code. Two cases are also launched as processes, for what only a process shows: a flag
case as `python` (the real exit code, no traceback on the real stderr), and a data case
under 2-process torchrun (every rank reads the data; only rank 0 may speak). torchrun
itself answers any worker's non-zero exit with its own ChildFailedError report (a
traceback of torchrun's frames) and rc 1; the workers exit 2.
"""
import os
import re

import numpy as np
import pytest

from tests.support.assertions import error_lines, outputs_digest, worker_tracebacks
from tests.support.jobs import JobSpec, run_all, run_trainer
from tests.support.run_outputs import checkpoint_name, latest_link_name, out_args
from tests.support.tiny import TINY

DATA = {
    # name: (file bytes or None for a missing file, expected message fragment)
    "not_json": (b'{"text": "fine"}\n{"text": "fine"}\nnot json at all\n', "data.jsonl:3: not valid JSON"),
    "no_text_field": (b'{"text": "fine"}\n{"content": "x"}\n', 'data.jsonl:2: JSON object has no "text" field'),
    "empty_file": (b"", "data.jsonl: file is empty (0 bytes)"),
    "missing_file": (None, "data.jsonl: not found: pass --data_path"),
    "not_utf8": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "data.jsonl:2: not valid UTF-8 (byte 0xe9"),
    "fewer_than_a_batch": (b'{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n',
                           "--data_path {data}: 3 training samples, fewer than one global batch of {batch} "
                           "(--batch_size 4 x {nproc} processes x 1 accumulation steps)"),
    # a packed file (written by write_bin) with an id past the model's 6400: found at open, not at the batch
    "bin_id_past_vocab": ("write_bin", "data.bin: holds token id 7000, but the model's vocab_size is 6400"),
}


def write_bin(path):
    from dataset.packed_dataset import write_meta

    tokens = np.full(4096, 9, dtype=np.uint16)
    tokens[3000] = 7000
    tokens.tofile(path)
    write_meta(path, vocab_size=6400, num_tokens=len(tokens), num_docs=1, bos_token_id=1, eos_token_id=2,
               tokenizer="hand-made")
FLAGS = {
    "batch_size_0": (["--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    "accumulation_steps_0": (["--accumulation_steps", "0"], "--accumulation_steps must be at least 1, got 0"),
    "float16_on_cpu": (["--dtype", "float16"], "--dtype float16 needs CUDA"),
    "seq_len_too_long": (["--max_seq_len", "40000"],
                         "--max_seq_len 40000 exceeds the model's max_position_embeddings 32768"),
    "vocab_smaller_than_tokenizer": (["--vocab_size", "1000"], "has 6400 tokens but the model's --vocab_size is 1000"),
    "eval_task_missing": (["--eval_task", "/nonexistent/task.jsonl"],
                          "/nonexistent/task.jsonl: not found: pass --eval_task an existing .jsonl file"),
}


def plant_checkpoints(run_dir):
    """What an earlier run left: a checkpoint, its record, the link, the weights."""
    ckpt, out = run_dir / "ckpt", run_dir / "out"
    ckpt.mkdir(parents=True)
    out.mkdir()
    (ckpt / checkpoint_name(4)).write_bytes(os.urandom(4096))
    (ckpt / f"{checkpoint_name(4)}.json").write_text('{"global_step": 4}')
    os.symlink(checkpoint_name(4), ckpt / latest_link_name())
    (out / "pretrain_64.pth").write_bytes(os.urandom(1024))


# case: processes, for the cases also launched as processes.
LAUNCHED = {"float16_on_cpu": 1, "fewer_than_a_batch": 2}


def prepare(root, case, nproc):
    """(flags, run dir, expected message) of a case, with checkpoints planted in its run dir."""
    run = root / case
    if case in DATA:
        content, message = DATA[case]
        data = root / f"{case}_data" / ("data.bin" if content == "write_bin" else "data.jsonl")
        data.parent.mkdir()
        if content == "write_bin":
            write_bin(data)
        elif content is not None:
            data.write_bytes(content)
        # --save_interval 1: any step that slipped through would write (and rotate) checkpoints.
        flags = [*TINY, *out_args(run), "--data_path", str(data), "--max_steps", "2", "--save_interval", "1"]
        message = message.format(data=data, batch=4 * nproc, nproc=nproc)
    else:
        extra, message = FLAGS[case]
        flags = [*TINY, *out_args(run), "--max_steps", "2", "--save_interval", "1", *extra]
    plant_checkpoints(run)
    return flags, run, message


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    results = {}
    for case in [*DATA, *FLAGS]:
        flags, run, message = prepare(root, case, 1)
        before = outputs_digest(run)
        results[case] = (run_trainer(flags, run), message, run, before)
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input_launched")
    jobs, cases = {}, {}
    for case, nproc in LAUNCHED.items():
        flags, run, message = prepare(root, case, nproc)
        jobs[case] = JobSpec(flags, run, nproc=nproc, mode=("python" if nproc == 1 else "torchrun"))
        cases[case] = (message, run, outputs_digest(run))
    results = run_all(jobs, timeout=120)
    return {case: (results[case], *cases[case]) for case in jobs}


@pytest.mark.parametrize("case", [*DATA, *FLAGS])
def test_one_line_error_nonzero_exit_and_checkpoints_untouched(failed, case):
    result, message, run, before = failed[case]
    out = result.stdout
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1, f"expected one error line, got {lines}\n{out[-3000:]}"
    assert message in lines[0], lines[0]
    assert out.count(message) == 1
    assert outputs_digest(run) == before


@pytest.mark.slow
@pytest.mark.parametrize("case", LAUNCHED)
def test_launched_one_line_error_nonzero_exit_and_checkpoints_untouched(launched, case):
    result, message, run, before = launched[case]
    out = result.stdout
    assert result.returncode is not None, f"no exit within the timeout:\n{out[-3000:]}"
    assert result.returncode != 0, out[-3000:]
    if case in FLAGS:
        assert result.returncode == 2
        assert "Traceback" not in out, out[-3000:]
    else:
        assert result.returncode == 1  # torchrun's code for a failed worker (the workers exit 2)
        assert "exitcode  : 2" in out
        assert not worker_tracebacks(out), worker_tracebacks(out)[0]
    lines = error_lines(out)
    assert len(lines) == 1, f"expected one error line (rank 0 only), got {lines}\n{out[-3000:]}"
    assert message in lines[0], lines[0]
    if case in FLAGS:
        assert out.count(message) == 1
    else:  # and torchrun's failure report names that line as its root cause
        assert out.count(message) == 2 and re.search(r"(?m)^\s*traceback\s*: error: ", out), out[-3000:]
    assert outputs_digest(run) == before


# ---------------------------------------------------------------------------- a one-line stop in torchrun's report
def _bad_flag():
    from common.cli import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="train_pretrain.py")
    parser.add_argument("--max_steps", type=int)
    parser.parse_args(["--max_steps", "ten"])


def _script_user_error():
    from common.errors import DataError, report_user_errors

    @report_user_errors
    def main():
        raise DataError("corpus.jsonl:3: not JSON; fix that line")
    main()


def _stalled_rank(monkeypatch):
    from trainer.distributed import fail

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    fail("rank 1: no batch from its DataLoader worker", code=1, this_rank_only=True)


@pytest.mark.parametrize("stop", ["bad flag", "script", "stalled rank"])
def test_a_one_line_stop_gives_its_line_to_torchrun_s_report(tmp_path, monkeypatch, capsys, stop):
    """Under torchrun (TORCHELASTIC_ERROR_FILE set), the line goes to this worker's error file too,
    read here as torchrun reads it: its failure report then shows the line, not "<N/A>" (the lost
    peer's line, under a real torchrun: test_fault_tolerance.py)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    stops = {"bad flag": _bad_flag, "script": _script_user_error, "stalled rank": lambda: _stalled_rank(monkeypatch)}
    with pytest.raises(SystemExit):
        stops[stop]()
    [line] = capsys.readouterr().err.splitlines()
    assert "error: " in line
    assert ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file)).message == line
