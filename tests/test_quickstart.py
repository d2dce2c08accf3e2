"""scripts/quickstart.sh end to end at a tiny size, and its two helpers
(scripts/split_corpus.py, scripts/unigram_baseline.py) against hand computations.

The real quick start trains for minutes; here the same script runs with QS_* overrides
(hidden 64, 2 layers, 10 steps) on a small synthetic corpus, so every stage still runs
for real -- torchrun with 2 processes, eval, plot, export -- in well under a minute.
"""
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.errors import DataError
from dataset.packed_dataset import write_meta
from scripts.split_corpus import split_corpus
from scripts.unigram_baseline import unigram_baseline
from tests.support.assertions import assert_clean_exit
from tests.support import REPO_ROOT
from tests.support.jobs import run_env

QUICKSTART = REPO_ROOT / "scripts" / "quickstart.sh"

SUMMARY = re.compile(r"quickstart summary: steps=(\d+) final_train_loss=(\S+) final_val_loss=(\S+) "
                     r"unigram_baseline=(\S+) beats_unigram=(yes|no) val_ppl=(\S+) wall=(\d+)s "
                     r"val_bits_per_byte=(\S+) acc=(\S+) acc_norm=(\S+) chance=(\S+)")


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def synthetic_corpus(n_docs=240, seed=0):
    """Docstring-like English, enough packed windows of 64 tokens for both splits."""
    rng = random.Random(seed)
    words = ("return the value of a list string object file path number if none is given else raise "
             "an error when it cannot be found this function module class method call").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(15, 40))).capitalize() + "."
            for _ in range(n_docs)]


def torchrun_path(tmp_path):
    """The venv's torchrun; else a one-line wrapper, since the script takes one command path."""
    beside = Path(sys.executable).parent / "torchrun"
    if beside.exists():
        return str(beside)
    wrapper = tmp_path / "torchrun"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


# -----------------------------------------------------------------------------
# the whole script

@pytest.fixture(scope="module")
def quickstarted(tmp_path_factory):
    """quickstart.sh at a tiny size, run from outside the repo: (the folder it ran in, its
    environment, its output)."""
    tmp_path = tmp_path_factory.mktemp("quickstart")
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, synthetic_corpus())
    work = tmp_path / "elsewhere"  # run from a directory that is not the repo root
    work.mkdir()
    env = run_env(tmp_path, {
        # No QS_PORT: the script's torchrun --standalone picks its own port.
        "PYTHON": sys.executable, "TORCHRUN": torchrun_path(tmp_path),
        "QS_OUT": "qs",  # relative: must land under the caller's directory, not the repo's
        "QS_CORPUS": str(corpus), "QS_HIDDEN": "64", "QS_LAYERS": "2", "QS_SEQ": "64", "QS_BATCH": "4",
        "QS_STEPS": "10", "QS_WARMUP": "2", "QS_EVAL_INTERVAL": "5", "QS_VAL_EVERY": "10",
        "QS_MAX_NEW_TOKENS": "8", "TQDM_DISABLE": "1",
    })
    result = subprocess.run(["bash", str(QUICKSTART)], cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert_clean_exit(result.returncode, result.stdout, "quickstart.sh")  # its torchrun stage included
    return work, env, result.stdout


@pytest.mark.slow
def test_quickstart_runs_every_stage(quickstarted):
    work, _, log = quickstarted
    for stage in range(1, 7):
        assert f"==== [{stage}/6]" in log, f"stage {stage} did not run:\n{log[-4000:]}"

    out = work / "qs"
    pth, metrics, png, hf = out / "quickstart_64.pth", out / "quickstart_64_metrics.jsonl", out / "loss.png", out / "hf"
    assert pth.is_file() and pth.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (REPO_ROOT / "qs").exists()

    # Training ran 10 steps with validation on the held-out .bin (every 5 steps).
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    assert train[-1]["step"] == 10 and [r["step"] for r in val] == [5, 10]
    assert "world_size=2" in log

    # The split held out every 10th of 240 documents, and nothing else.
    assert len((out / "data" / "val.jsonl").read_text().splitlines()) == 24
    assert len((out / "data" / "train.jsonl").read_text().splitlines()) == 216

    # Stock transformers loads the export, with no trust_remote_code.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert re.search(rf"verified: AutoModelForCausalLM\.from_pretrained\('{re.escape(str(hf))}'\) -> {type(model).__name__}, ",
                     log), log[-4000:]

    # The sample starts with the prompt; the perplexity line is self-consistent.
    assert re.search(r"^Return the", log, re.M), log[-4000:]
    ppl_line = re.search(r"ppl_data=\S+ docs=24 tokens=\d+ loss=(\S+) ppl=(\S+)", log)
    assert ppl_line, log[-4000:]
    assert float(ppl_line[2]) == pytest.approx(math.exp(float(ppl_line[1])), rel=1e-5)

    # The summary line is the last line and agrees with the files it summarises.
    summary = SUMMARY.fullmatch(log.strip().splitlines()[-1])
    assert summary, log[-2000:]
    steps, train_loss, val_loss, baseline, beats, ppl = summary.groups()[:6]
    assert int(steps) == 10
    assert float(train_loss) == pytest.approx(train[-1]["loss"], abs=1e-4)
    assert float(val_loss) == pytest.approx(val[-1]["val_loss"], abs=1e-4)
    expected = unigram_baseline(out / "data" / "train.bin", out / "data" / "val.bin")["val"]
    assert float(baseline) == pytest.approx(expected, abs=1e-4)
    assert beats == ("yes" if float(val_loss) < float(baseline) else "no")
    assert ppl == ppl_line[2]
    assert float(summary[8]) == pytest.approx(val[-1]["val_bpb"], abs=1e-4)

    # Downstream accuracy: on a corpus of its own the script builds the task from that
    # corpus's held-out documents, and scores it with eval_llm.py --task.
    task = out / "data" / "task.jsonl"
    assert task.is_file() and re.search(rf"^ +task +{re.escape(str(task))}$", log, re.M), log[-4000:]
    acc_line = re.search(r"^acc=(\S+) acc_norm=(\S+) acc_stderr=(\S+) acc_norm_stderr=(\S+)$", log, re.M)
    assert acc_line, log[-4000:]
    assert (summary[9], summary[10]) == (acc_line[1], acc_line[2]) and summary[11] == "0.2500"
    assert 0 <= float(acc_line[1]) <= 1 and 0 <= float(acc_line[2]) <= 1
    n_items = len(task.read_text().splitlines())
    assert re.search(rf"^downstream: acc {acc_line[1]} ± {acc_line[3]}, acc_norm {acc_line[2]} ± {acc_line[4]} "
                     rf"on {n_items} items, chance 0\.2500: acc - chance = -?[\d.]+ stderr$", log, re.M), log[-4000:]


SFT_SUMMARY = re.compile(r"quickstart_sft summary: steps=(\d+) base_reply_loss=(\S+) sft_reply_loss=(\S+) "
                         r"base_acc=(\S+) sft_acc=(\S+) acc_gain=(\S+) paired_stderr=(\S+) chance=(\S+) wall=(\d+)s")


@pytest.mark.slow
def test_quickstart_sft_fine_tunes_the_quickstart_model(quickstarted, tmp_path):
    """quickstart_sft.sh on the tiny pre-trained model above, with conversations of its own: it
    scores the base model, fine-tunes it under torchrun, scores it again, answers a question
    and exports a folder whose tokenizer carries the chat template."""
    from tests.support.helpers_data import write_conversations

    work, env, _ = quickstarted
    write_conversations(tmp_path / "chat.jsonl", n=120)
    write_conversations(tmp_path / "chat_heldout.jsonl", n=20)
    env = dict(env, QS_SFT_CORPUS=str(tmp_path / "chat.jsonl"), QS_SFT_STEPS="4", QS_SFT_SEQ="64",
               QS_SFT_BATCH="2", QS_SFT_QUESTION="What is 3?")
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "quickstart_sft.sh")], cwd=work, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)
    log = result.stdout
    assert_clean_exit(result.returncode, log, "quickstart_sft.sh")
    for stage in range(1, 7):
        assert f"==== [{stage}/6]" in log, f"stage {stage} did not run:\n{log[-4000:]}"
    assert "using " + str(work / "qs" / "quickstart_64.pth") in log  # the quick start's model, not a new one
    sft = work / "qs" / "sft"
    assert (sft / "quickstart_sft_64.pth").is_file() and (sft / "hf" / "chat_template.jinja").is_file()
    assert "world_size=2" in log and "user: What is 3?\nassistant: " in log
    assert len((sft / "data" / "task.jsonl").read_text().splitlines()) == 20
    summary = SFT_SUMMARY.fullmatch(log.strip().splitlines()[-1])
    assert summary, log[-3000:]
    assert int(summary[1]) == 4 and summary[8] == "0.2500"
    replies = re.findall(r"conversations=\d+ reply_tokens=\d+ loss=(\S+)", log)
    assert replies == [summary[2], summary[3]], log[-3000:]
    acc = re.search(r"^metric=acc items=20 chance=0\.2500 a=(\S+) b=(\S+) b_minus_a=(\S+) paired_stderr=(\S+) ", log, re.M)
    assert acc and acc.groups() == summary.groups()[3:7], log[-3000:]
    assert float(acc[3]) == pytest.approx(float(acc[2]) - float(acc[1]), abs=1e-4)


# -----------------------------------------------------------------------------
# helpers

def test_split_corpus_every_nth_document_to_val(tmp_path):
    src = tmp_path / "c.jsonl"
    docs = [f"doc {i}" for i in range(7)]
    # A blank line is dropped and does not count; a missing final newline is added.
    src.write_bytes(("\n".join(json.dumps({"text": d}) for d in docs[:3]) + "\n\n"
                     + "\n".join(json.dumps({"text": d}) for d in docs[3:])).encode())
    n_train, n_val = split_corpus(src, tmp_path / "t.jsonl", tmp_path / "v.jsonl", every=3)
    read = lambda p: [json.loads(line)["text"] for line in p.read_text().splitlines()]  # noqa: E731
    assert read(tmp_path / "v.jsonl") == ["doc 2", "doc 5"]
    assert read(tmp_path / "t.jsonl") == ["doc 0", "doc 1", "doc 3", "doc 4", "doc 6"]
    assert (n_train, n_val) == (5, 2)


def test_split_corpus_refuses_an_empty_val_side(tmp_path):
    src = tmp_path / "c.jsonl"
    write_jsonl(src, ["a", "b"])
    with pytest.raises(DataError, match="lower --every"):
        split_corpus(src, tmp_path / "t.jsonl", tmp_path / "v.jsonl", every=3)
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "v.jsonl").exists()


def write_bin(path, tokens, vocab_size):
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    write_meta(path, vocab_size=vocab_size, num_tokens=len(tokens), num_docs=1, bos_token_id=1,
               eos_token_id=2, tokenizer="test")


def test_unigram_baseline_matches_hand_computation(tmp_path):
    vocab = 8
    train, val = [1, 5, 5, 5, 3, 2], [1, 5, 7, 2]
    write_bin(tmp_path / "t.bin", train, vocab)
    write_bin(tmp_path / "v.bin", val, vocab)
    # add-one: p(k) = (count(k) + 1) / (6 + 8); the first token of a stream is never a target
    p = {k: (train.count(k) + 1) / (len(train) + vocab) for k in range(vocab)}
    expected_val = -sum(math.log(p[k]) for k in val[1:]) / 3
    expected_train = -sum(math.log(p[k]) for k in train[1:]) / 5
    r = unigram_baseline(tmp_path / "t.bin", tmp_path / "v.bin")
    assert r["val"] == pytest.approx(expected_val, rel=1e-12)
    assert r["train"] == pytest.approx(expected_train, rel=1e-12)

    # The CLI prints the val number as loss= with its perplexity.
    cli = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "unigram_baseline.py"),
                          "--train_bin", str(tmp_path / "t.bin"), "--val_bin", str(tmp_path / "v.bin")],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert cli.returncode == 0, cli.stderr
    line = cli.stdout.splitlines()[0]
    assert re.fullmatch(rf"unigram_baseline train=\S+ val=\S+ loss={expected_val:.4f} nats "
                        rf"\(ppl={math.exp(expected_val):.2f}\)", line), line


def test_unigram_baseline_rejects_mismatched_vocabularies(tmp_path):
    write_bin(tmp_path / "t.bin", [1, 2, 3], 8)
    write_bin(tmp_path / "v.bin", [1, 2, 3], 16)
    with pytest.raises(DataError, match="different vocabularies"):
        unigram_baseline(tmp_path / "t.bin", tmp_path / "v.bin")
