"""The packed (.bin) path through the real trainer: it trains every token, resumes
exactly, and --doc_mask keeps attention inside documents."""
import json

import pytest

from tests.launch_utils import (
    TINY, assert_bitwise_equal, latest_checkpoint, out_args, run_training, small_corpus,
)


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("packed"))[1]


def _args(corpus, run_dir, *extra):
    return [*TINY, "--data_path", str(corpus), *out_args(run_dir), "--max_steps", "6", "--save_interval", "3", *extra]


def test_packed_run_trains_only_real_tokens_and_resumes_exactly(packed_corpus, tmp_path):
    straight = run_training(2, _args(packed_corpus, tmp_path / "straight"), tmp_path)
    assert straight.returncode == 0, straight.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "straight" / "out" / "pretrain_64_metrics.jsonl").open()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    # No padding: every position of every window is a real next-token target.
    assert train_rows[-1]["tokens_seen"] == 6 * 8 * 64

    killed = run_training(2, _args(packed_corpus, tmp_path / "resumed"), tmp_path,
                          env={"MINIMIND_FAULT_AT_STEP": "4", "MINIMIND_FAULT_RANK": "1"})
    assert killed.returncode != 0
    resumed = run_training(2, _args(packed_corpus, tmp_path / "resumed", "--from_resume", "1"), tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "at step 3/6" in resumed.stdout
    assert_bitwise_equal(latest_checkpoint(tmp_path / "straight")["model"],
                         latest_checkpoint(tmp_path / "resumed")["model"])


def test_doc_mask_trains(packed_corpus, tmp_path):
    result = run_training(1, _args(packed_corpus, tmp_path, "--doc_mask", "1", "--max_steps", "2"), tmp_path,
                          launcher="python")
    assert result.returncode == 0, result.stdout[-3000:]
    assert latest_checkpoint(tmp_path)["global_step"] == 2
