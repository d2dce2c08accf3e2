"""NorMuon (trainer/optim.py's row_stats and rescale), computed by hand: what it does to an
update, and what it keeps in the optimizer's state. Its split across ranks and its resume are
tests/test_muon.py's."""
import pytest
import torch

from trainer.optim import Muon, rescale, row_stats


def matrices(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


# ---------------------------------------------------------------------------- NorMuon
def normuon(updates, moments, beta2):
    """NorMuon's two halves on whole matrices, as one process's Muon runs them."""
    figures, inv_rms = row_stats(updates, moments, beta2)
    return rescale(updates, inv_rms, figures)


def test_normuon_hand_computed():
    """O = [[1, 1], [2, 0]]: row mean squares 1 and 2; from v = 0 with beta2 0.5, v = [0.5, 1].
    O / sqrt(v) = [[sqrt 2, sqrt 2], [2, 0]], of squared norm 8 where O's is 6, so the update is
    that times sqrt(6 / 8) = [[sqrt 1.5, sqrt 1.5], [sqrt 3, 0]]. Step 2, O = [[0, 2], [1, 1]]
    (mean squares 2 and 1): v = 0.5 v + 0.5 [2, 1] = [1.25, 1]; O / sqrt(v) = [[0, 2 / sqrt 1.25],
    [1, 1]], squared norm 3.2 + 2 = 5.2 against 6."""
    v = torch.zeros(2)
    (first,) = normuon([torch.tensor([[1.0, 1.0], [2.0, 0.0]])], [v], beta2=0.5)
    torch.testing.assert_close(v, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(first, torch.tensor([[1.5 ** 0.5, 1.5 ** 0.5], [3 ** 0.5, 0.0]]))
    (second,) = normuon([torch.tensor([[0.0, 2.0], [1.0, 1.0]])], [v], beta2=0.5)
    torch.testing.assert_close(v, torch.tensor([1.25, 1.0]))
    scale = (6 / 5.2) ** 0.5
    torch.testing.assert_close(second, torch.tensor([[0.0, 2 / 1.25 ** 0.5 * scale], [scale, scale]]))
    assert second.norm().item() == pytest.approx(6 ** 0.5)


def test_normuon_keeps_its_moments_in_the_state_and_a_zero_update_finite():
    """v, one per row, in the state beside the momentum buffer; a matrix whose gradient is 0
    (O = 0, v = 0) steps by 0, not NaN."""
    params = [torch.nn.Parameter(m) for m in matrices((32, 64), (64, 32))]
    opt = Muon(params, normuon=True)
    params[0].grad, params[1].grad = torch.randn(32, 64), torch.zeros(64, 32)
    before = params[1].detach().clone()
    opt.step()
    assert [opt.state[p]["row_second_moment"].shape for p in params] == [(32,), (64,)]
    assert opt.state[params[0]].keys() == {"momentum_buffer", "row_second_moment"}
    assert (opt.state[params[0]]["row_second_moment"] > 0).all() and torch.equal(params[1], before)
