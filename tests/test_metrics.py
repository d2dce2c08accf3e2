"""MFU's inputs: the GPU peak looked up by device name, and the loop's clock, which counts
training time only (validation and checkpoint saves left out)."""
import json
import time
from types import SimpleNamespace

import pytest
import torch

from tests.support.helpers_data import SAMPLE_TEXTS
from tests.support.jobs import run_trainer
from trainer import loop
from trainer.checkpoint import CheckpointManager
from trainer.metrics import RunLogger, Throughput, device_peak_flops, peak_bf16_tflops

# torch.cuda.get_device_name() strings, as the drivers report them.
NAMES = [
    ("NVIDIA H100 80GB HBM3", 989.0),     # SXM
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),               # SXM
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA H800", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA GeForce RTX 4090", 165.0),
    ("NVIDIA GeForce RTX 3090", 71.0),
    ("Tesla V100-SXM2-16GB", 125.0),
    ("NVIDIA GH200 480GB", 989.0),
]


@pytest.mark.parametrize("name,tflops", NAMES)
def test_peak_bf16_tflops_by_device_name(name, tflops):
    assert peak_bf16_tflops(name) == tflops


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4080", "NVIDIA A40", "NVIDIA A1000", "NVIDIA L20", "AMD Instinct MI300X"])
def test_unknown_gpus_have_no_peak(name):
    assert peak_bf16_tflops(name) is None


def test_a_cpu_has_no_peak():
    assert device_peak_flops(torch.device("cpu")) is None


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_one_clock_leaves_paused_time_out_of_training_time_and_rates(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(loop.time, "perf_counter", fake)
    clock = loop.TrainClock()
    meter = Throughput(tokens_per_step=100, clock=clock)
    fake.now += 2  # training: step 1, 80 real tokens
    with clock.paused():
        fake.now += 50  # a validation or a save
    fake.now += 2  # training: step 2, 80 real tokens
    assert (clock.training_seconds(), clock.wall_seconds()) == (4, 54)  # tokens/s and train_s; the ETA
    assert meter.report(step=2, tokens_seen=160) == (200 / 4, 160 / 4)
    fake.now += 1
    assert meter.report(step=3, tokens_seen=260) == (100, 100)  # report() starts the next interval


def test_trainer_rates_exclude_validation_and_checkpoint_time(tmp_path, monkeypatch):
    """A real in-process run whose every validation and save 'takes' 100 s of the clock:
    tokens/s must not see them (without the pause it would fall below 2)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in SAMPLE_TEXTS * 8))
    clock = {"offset": 0.0}
    real_counter = time.perf_counter
    monkeypatch.setattr(loop.time, "perf_counter", lambda: real_counter() + clock["offset"])

    def slow(fn):
        def wrapped(*args, **kwargs):
            clock["offset"] += 100
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(loop, "validate", slow(loop.validate))
    monkeypatch.setattr(CheckpointManager, "save", slow(CheckpointManager.save))
    run = run_trainer([
        "--data_path", str(data), "--device", "cpu", "--hidden_size", "64", "--num_hidden_layers", "2",
        "--max_seq_len", "32", "--batch_size", "2", "--max_steps", "6", "--log_interval", "2",
        "--save_interval", "2", "--eval_interval", "2", "--val_fraction", "0.2", "--eval_batches", "1",
        "--num_workers", "0", "--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
    ], tmp_path / "run")
    assert run.returncode == 0, run.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "pretrain_64_metrics.jsonl").open()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4, 6] and clock["offset"] >= 600
    # The intervals up to steps 4 and 6 each hold a validation and a save (200 s on the clock):
    # counted, they would make 2 steps x 2 x 32 tokens < 0.7 tokens/s. Left out, the rate is
    # 128 tokens over the real time of 2 tiny steps (well under 60 s even on a busy machine).
    rates = [r["tokens_per_s"] for r in train_rows[1:]]
    assert all(rate > 128 / 60 for rate in rates), rates
    # The same clock gives the validations' train_s, the x axis of time-to-loss plots.
    assert all(r["train_s"] < 60 for r in rows if r["kind"] == "val"), rows


@pytest.mark.parametrize("from_resume,global_step,tokens_seen,steps_kept", [
    (1, 4, 800, [1, 2, 3, 4, 5, 5, 6, 7, 8, 8]),  # 1 process's step 8 resumed as 2 processes' step 4: none redone
    (1, 5, 500, [1, 2, 3, 4, 5, 5]),  # a resume at the same world size from step 5: steps 6 to 8 are redone
    (0, 0, 0, []),  # a fresh run starts its own file
])
def test_a_resume_keeps_the_metrics_rows_its_checkpoint_trained_past(tmp_path, from_resume, global_step, tokens_seen,
                                                                      steps_kept):
    """The rows kept are those up to the checkpoint's tokens trained, whatever the step numbers
    of the resumed run: a resume on twice the world size renumbers step 8 as step 4."""
    path = tmp_path / "run_metrics.jsonl"
    rows = [{"kind": "train", "step": step, "tokens_seen": 100 * step} for step in range(1, 9)]
    rows.insert(8, {"kind": "val", "step": 8, "tokens_seen": 800})
    rows.insert(5, {"kind": "val", "step": 5, "tokens_seen": 500})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    state = SimpleNamespace(plan=SimpleNamespace(total_steps=10, epochs=1), global_step=global_step,
                            tokens_seen=tokens_seen, wandb_run_id=None)
    output = SimpleNamespace(save_dir=str(tmp_path), from_resume=from_resume, use_wandb=0)
    RunLogger(str(path), output, "run", state, {}, enabled=True, clock=None)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == steps_kept


def test_a_row_cut_off_mid_write_is_dropped_at_a_resume_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "run_metrics.jsonl"
    rows = [json.dumps({"kind": "train", "step": step, "tokens_seen": 100 * step}) + "\n" for step in (1, 2)]
    path.write_text("".join(rows) + '[1, 2]\n{"kind": "train", "step": 3, "tok')  # a full disk, mid-append
    state = SimpleNamespace(plan=SimpleNamespace(total_steps=10, epochs=1), global_step=2, tokens_seen=200,
                            wandb_run_id=None)
    output = SimpleNamespace(save_dir=str(tmp_path), from_resume=1, use_wandb=0)
    RunLogger(str(path), output, "run", state, {}, enabled=True, clock=None)
    assert path.read_text() == "".join(rows)
    assert "dropped 2 row(s) that are not whole JSON objects" in capsys.readouterr().out
