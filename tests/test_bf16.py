"""Training under bf16 autocast on a CPU, end to end in the trainer: what --dtype auto picks
where the CPU has amx_bf16 or avx512_bf16 (tests/test_auto.py tests that choice). Every
other trainer test pins --dtype float32 (tests/support/tiny.py's TINY says why), so these
runs are the suite's bf16 training. A CPU without native bf16 runs them too, emulating bf16
(slower).

In-process runs (tests/support/jobs.py's run_trainer) on the first documents of the demo corpus.
"""
import pytest

from tests.support.fault_injection import fault_env
from tests.support.assertions import assert_bitwise_equal, assert_same_state
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args, read_metrics
from tests.support.tiny import TINY, small_corpus

STEPS, SAVE = 30, 15


def args_for(run_dir, corpus, dtype, *extra) -> list:
    # Later flags win in argparse: --dtype overrides TINY's float32. The optimizer is named: on a
    # CPU that emulates bf16, --optimizer auto gives a bf16 run AdamW and an fp32 run Muon
    # (trainer/auto.py), and these runs compare precisions, not optimizers.
    return [*TINY, "--dtype", dtype, "--optimizer", "muon", "--data_path", str(corpus), "--max_steps", str(STEPS),
            "--save_interval", str(SAVE), "--val_fraction", "0.1", *out_args(run_dir), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run_dir, InProcessRun)}: bf16 and fp32 uninterrupted, and a bf16 run that
    raises before step SAVE + 2 (its last checkpoint is at SAVE), then resumes."""
    work = tmp_path_factory.mktemp("bf16")
    corpus, _ = small_corpus(work)
    done = {}
    for name, dtype, env in [("bf16", "bfloat16", None), ("fp32", "float32", None),
                             ("interrupted", "bfloat16", fault_env("raise", at=SAVE + 2, rank=0))]:
        done[name] = (work / name, run_trainer(args_for(work / name, corpus, dtype), work / name, env=env))
    run_dir = work / "interrupted"
    done["resumed"] = (run_dir, run_trainer(args_for(run_dir, corpus, "bfloat16", "--from_resume", "1"), run_dir))
    return done


def test_the_run_says_it_trains_in_bf16(runs):
    _, result = runs["bf16"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dtype: bfloat16 (--dtype)" in result.stdout
    assert "dtype=bfloat16" in result.stdout


def test_bf16_resume_is_bitwise_identical(runs):
    """The autocast state is nothing a checkpoint must hold: the weights, the fp32 optimizer
    state and the random generators bring a bf16 run back exactly."""
    _, interrupted = runs["interrupted"]
    assert interrupted.returncode == 1 and f"raises at step {SAVE + 2}" in interrupted.stdout
    run_dir, resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"at step {SAVE}/{STEPS}" in resumed.stdout
    final, whole = latest_checkpoint(run_dir), latest_checkpoint(runs["bf16"][0])
    assert final["global_step"] == whole["global_step"] == STEPS
    assert_bitwise_equal(final["model"], whole["model"])
    assert_same_state(final["optimizer"], whole["optimizer"], "optimizer")


def test_bf16_validation_loss_is_within_1_percent_of_fp32(runs):
    """The same steps on the same data: bf16 autocast must not cost quality. The weights
    and the optimizer stay fp32 under autocast; only the matmuls' inputs are rounded."""
    (bf16_dir, bf16), (fp32_dir, fp32) = runs["bf16"], runs["fp32"]
    assert bf16.returncode == 0 and fp32.returncode == 0, (bf16.stdout[-2000:], fp32.stdout[-2000:])
    bf16_val, fp32_val = read_metrics(bf16_dir, kind="val")[-1], read_metrics(fp32_dir, kind="val")[-1]
    assert bf16_val["step"] == fp32_val["step"] == STEPS
    assert bf16_val["val_loss"] != fp32_val["val_loss"]  # the two runs really took different paths
    assert abs(bf16_val["val_loss"] - fp32_val["val_loss"]) <= 0.01 * fp32_val["val_loss"]
    assert abs(bf16_val["val_bpb"] - fp32_val["val_bpb"]) <= 0.01 * fp32_val["val_bpb"]
