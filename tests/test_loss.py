"""model/loss.py: the chunked cross-entropy against hand arithmetic and F.cross_entropy."""
import math

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_module
from common.labels import IGNORE_INDEX
from model.loss import ChunkedCrossEntropy, causal_lm_loss, chunk_elements, row_chunks


def test_loss_and_gradient_by_hand_one_row_per_chunk():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)],   # softmax (1/4, 1/4, 1/2), target 2
                           [5.0, -1.0, 2.0],             # target -100: no loss, no gradient
                           [math.log(3.0), 0.0, 0.0]],   # softmax (3/5, 1/5, 1/5), target 0
                          dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([2, -100, 0])
    total = ChunkedCrossEntropy.apply(logits, targets, 3)  # 3 words a chunk: one row each
    # -log(1/2) - log(3/5)
    assert total.item() == pytest.approx(math.log(2.0) + math.log(5.0 / 3.0), abs=1e-12)
    (2.0 * total).backward()
    expected = 2.0 * torch.tensor([[0.25, 0.25, 0.5 - 1.0],
                                   [0.0, 0.0, 0.0],
                                   [0.6 - 1.0, 0.2, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("elements", [50, 7 * 50, 1 << 22])  # a row, a remainder chunk, one chunk
def test_matches_f_cross_entropy_across_chunk_boundaries(elements):
    torch.manual_seed(0)
    logits = (3 * torch.randn(37, 50)).requires_grad_()
    targets = torch.randint(0, 50, (37,))
    targets[::5] = -100
    reference = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(reference, targets, ignore_index=-100, reduction="sum")
    expected.backward()
    total = ChunkedCrossEntropy.apply(logits, targets, elements)
    total.backward()
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(logits.grad, reference.grad)


def test_bf16_logits_get_an_fp32_gradient_rounded_to_bf16():
    # As F.cross_entropy(logits.float()) does for bf16 logits: fp32 arithmetic, a bf16 result
    # within a rounding (2 ** -8 relative) of the exact gradient.
    torch.manual_seed(0)
    logits = (3 * torch.randn(64, 300)).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (64,))
    exact = logits.detach().double().requires_grad_()
    expected = F.cross_entropy(exact, targets, reduction="sum")
    expected.backward()
    total = ChunkedCrossEntropy.apply(logits, targets)
    total.backward()
    assert total.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
    error = (logits.grad.double() - exact.grad).abs()
    assert (error <= exact.grad.abs() * 2 ** -8 + 1e-9).all(), error.max()


def test_minimind_labels_pad_the_last_target_instead_of_slicing_the_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 20)
    labels = torch.randint(0, 20, (2, 6))
    labels[1, 4:] = -100
    sliced = F.cross_entropy(logits[:, :-1].reshape(-1, 20), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(causal_lm_loss(logits, labels), sliced)


def test_a_cpu_takes_cache_sized_chunks_and_a_gpu_or_a_compiled_graph_fewer_larger_ones(monkeypatch):
    # 2,720 tokens of MiniMind's 6,400 words: 40-row chunks (1 MB of fp32) on a CPU, 655-row (16 MB) elsewhere.
    logits = torch.empty(2720, 6400, device="meta")
    cpu = row_chunks(logits, chunk_elements(torch.device("cpu")))
    gpu = row_chunks(logits, chunk_elements(torch.device("cuda")))
    assert [len(cpu), cpu[0]] == [68, slice(0, 40)] and [len(gpu), gpu[0]] == [5, slice(0, 655)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while dynamo traces the loss
    assert chunk_elements(torch.device("cpu")) == chunk_elements(torch.device("cuda"))


def test_the_model_and_the_data_share_one_ignore_index():
    # model/loss.py restates the convention (an export's remote code carries no common/).
    assert loss_module.IGNORE_INDEX == IGNORE_INDEX == -100
