"""The real training loop reads the device from the host at most once per optimizer step.

On a GPU every such read (`.item()`, `bool(t)`, `float(t)`: aten._local_scalar_dense; `.tolist()`)
waits until the queued kernels have run, so the host cannot queue the next step
meanwhile. The loop runs in this process under a dispatch mode that counts those
reads; a 10-step and a 30-step run differ only by 20 steps that neither log, save
nor evaluate, so the difference divided by 20 is the per-step figure.
"""
import sys

import pytest
import torch

from tests.support.host_reads import CountHostReads
from tests.support.jobs import run_in_process
from tests.support.run_outputs import out_args
from tests.support.tiny import small_corpus
from trainer.config import parse_config
from trainer.distributed import init_distributed_mode
from trainer.loop import train
from trainer.step import agree
from trainer.train_pretrain import PRETRAIN

FAR = "1000"  # log, save and eval intervals beyond the run: only the last step does them


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    padded, packed = small_corpus(tmp_path_factory.mktemp("syncs"))
    return {"packed": packed, "padded": padded}


def host_reads(data_path, run_dir, steps) -> int:
    """Host reads of a whole train() run, made in this process (run_in_process puts back the
    globals train() changes) so that the dispatch mode sees every read."""
    cfg, typed = parse_config(["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64",
                       "--batch_size", "4", "--num_workers", "0", "--val_fraction", "0.05", "--eval_batches", "1",
                       "--device", "cpu", "--data_path", str(data_path), *out_args(run_dir), "--max_steps", str(steps),
                       "--log_interval", FAR, "--save_interval", FAR, "--eval_interval", FAR])
    env = init_distributed_mode(cfg.system.device, cfg.system.dist_timeout, cfg.system.local_rank)
    with CountHostReads() as counter:
        done = run_in_process(lambda: sys.exit(train(cfg, typed, env, PRETRAIN)), run_dir)
    assert done.returncode == 0, done.stdout[-3000:]
    return counter.reads


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_at_most_one_host_read_per_optimizer_step(corpora, tmp_path, kind):
    short = host_reads(corpora[kind], tmp_path / "short", 10)
    long = host_reads(corpora[kind], tmp_path / "long", 30)
    assert short > 0, "the counter saw no host read at all: it is not counting"
    assert (long - short) / 20 <= 1, f"{(long - short) / 20:.2f} host reads per optimizer step"


def test_one_all_reduce_sums_the_figures_and_one_read_answers_the_questions():
    """agree() (trainer/step.py) answers every combination of yes and no, given as bools or device
    scalars (a count above 0 is yes), in one host read, and leaves the figures on the device."""
    figures = {"loss": torch.tensor(3.5), "aux_loss": torch.tensor(0.25)}
    for code in range(8):
        questions = {"bad_loss": torch.tensor(float(code & 1) * 3), "bad_grad": torch.tensor(float(code >> 1 & 1)),
                     "stop": bool(code >> 2 & 1)}
        with CountHostReads() as counter:
            summed, answers = agree(figures, questions)
        assert counter.reads == 1
        assert answers == {"bad_loss": bool(code & 1), "bad_grad": bool(code >> 1 & 1), "stop": bool(code >> 2 & 1)}
        assert {name: value.item() for name, value in summed.items()} == {"loss": 3.5, "aux_loss": 0.25}


def test_tolist_counts_as_a_host_read_and_is_put_back():
    tolist = torch.Tensor.tolist
    with CountHostReads() as counter:
        assert torch.arange(3).tolist() == [0, 1, 2]
        torch.ones(()).item()
    assert counter.reads == 2
    assert torch.Tensor.tolist is tolist
