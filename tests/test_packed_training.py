"""The packed (.bin) path through the real trainer: it trains every token, resumes
exactly, and --doc_mask keeps attention inside documents."""
import json

import pytest
import torch

from model.model_minimind import MiniMindForCausalLM
from tests.support.helpers_data import SAMPLE_TEXTS, write_jsonl
from tests.support.assertions import assert_bitwise_equal, assert_clean_exit, max_abs_diff
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args, read_metrics
from tests.support.tiny import TINY, small_corpus
from tests.support.fault_injection import fault_env

BOS = 1  # model/tokenizer.json's <|im_start|>, which starts every packed document


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("packed"))[1]


def _args(corpus, run_dir, *extra):
    return [*TINY, "--data_path", str(corpus), *out_args(run_dir), "--max_steps", "6", "--save_interval", "3", *extra]


@pytest.mark.slow
def test_packed_run_trains_only_real_tokens_and_resumes_exactly(packed_corpus, tmp_path):
    straight = run_trainer(_args(packed_corpus, tmp_path / "straight"), tmp_path, nproc=2, mode="forked")
    assert_clean_exit(straight.returncode, straight.stdout, "straight run")
    rows = [json.loads(line) for line in (tmp_path / "straight" / "out" / "pretrain_64_metrics.jsonl").open()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    # No padding: every position of every window is a real next-token target.
    assert train_rows[-1]["tokens_seen"] == 6 * 8 * 64

    killed = run_trainer(_args(packed_corpus, tmp_path / "resumed"), tmp_path, nproc=2, mode="forked",
                         env=fault_env("kill", at=4, rank=1))
    assert killed.returncode != 0
    resumed = run_trainer(_args(packed_corpus, tmp_path / "resumed", "--from_resume", "1"), tmp_path, nproc=2,
                          mode="forked")
    assert_clean_exit(resumed.returncode, resumed.stdout, "resumed run")
    assert "at step 3/6" in resumed.stdout
    assert_bitwise_equal(latest_checkpoint(tmp_path / "straight")["model"],
                         latest_checkpoint(tmp_path / "resumed")["model"])


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A packed corpus of ~20-token documents: every 64-token window holds several."""
    from scripts.prepare_data import prepare

    work = tmp_path_factory.mktemp("short_documents")
    texts = [f"document {i}: {SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]}" for i in range(400)]
    write_jsonl(work / "short.jsonl", texts)
    prepare(work / "short.jsonl", work / "short.bin", num_proc=1)
    return work / "short.bin"


def test_doc_mask_trains(short_documents, tmp_path, monkeypatch):
    """--doc_mask 1 hands the model a mask that keeps every position inside its document,
    and so trains differently from --doc_mask 0 on the same windows."""
    packed_corpus = short_documents
    seen = []  # (input_ids, attention_mask) of every training forward
    forward = MiniMindForCausalLM.forward

    def recording(self, input_ids, attention_mask=None, *args, **kwargs):
        seen.append((input_ids.clone(), attention_mask))
        return forward(self, input_ids, attention_mask, *args, **kwargs)

    monkeypatch.setattr(MiniMindForCausalLM, "forward", recording)
    masked = run_trainer(_args(packed_corpus, tmp_path / "masked", "--doc_mask", "1", "--max_steps", "2"),
                         tmp_path / "masked")
    assert masked.returncode == 0, masked.stdout[-3000:]
    assert latest_checkpoint(tmp_path / "masked")["global_step"] == 2
    assert len(seen) == 2
    for ids, mask in seen:
        # Windows that hold several documents: the case the mask is for.
        assert ((ids[:, 1:] == BOS).sum(dim=1) > 0).all()
        doc = torch.cumsum(ids == BOS, dim=1)
        T = ids.shape[1]
        allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
        assert mask is not None and mask.dtype == torch.bool
        assert torch.equal(mask.squeeze(1), allowed)  # causal, and never across a document start
        assert (~mask.squeeze(1)).tril(-1).any()  # some earlier positions are hidden

    masked_windows = [ids for ids, _ in seen]
    seen.clear()
    plain = run_trainer(_args(packed_corpus, tmp_path / "plain", "--doc_mask", "0", "--max_steps", "2"),
                        tmp_path / "plain")
    assert plain.returncode == 0, plain.stdout[-3000:]
    assert all(mask is None for _, mask in seen) and len(seen) == 2
    assert all(torch.equal(a, b) for a, (b, _) in zip(masked_windows, seen))  # the same windows...
    # ...yet, once the first step has moved the zero-initialised output projections off 0 (until
    # then each block adds nothing, masked or not: the same first loss), another loss and other weights.
    masked_loss, plain_loss = ([row["loss"] for row in read_metrics(tmp_path / run)] for run in ("masked", "plain"))
    assert masked_loss[0] == plain_loss[0] and masked_loss[1] != plain_loss[1]
    assert max_abs_diff(latest_checkpoint(tmp_path / "masked")["model"],
                        latest_checkpoint(tmp_path / "plain")["model"]) > 0
