"""The options of Muon's update, each on its own, computed by hand or against the exact
answer: Polar Express's Newton-Schulz (trainer/newton_schulz.py), NorMuon and cautious weight
decay (trainer/muon.py, trainer/weight_decay.py). Their split across ranks and their resume
are tests/test_muon.py's."""
import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.muon import Muon, rescale, row_stats
from trainer.newton_schulz import NS_COEFFICIENTS, NS_METHODS, iteration_plan, newton_schulz
from trainer.optim import is_block_matrix


def matrices(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


# ---------------------------------------------------------------------------- Polar Express
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_polar_express_ends_no_farther_from_the_orthogonal_factor_than_the_quintic(dtype):
    """On random matrices of the blocks' own shapes at hidden 256 (q/o, k/v, the MLP's both
    ways), each result's Frobenius distance from U V^T (the exact orthogonal factor, by SVD in
    float64) under Polar Express is at most the quintic's; measured, about half of it."""
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=256, num_hidden_layers=1))
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if is_block_matrix(n, p)})
    assert shapes == [(128, 256), (256, 256), (256, 832), (832, 256)]
    for shape in shapes:
        x = torch.stack(matrices(shape, shape, seed=len(shapes)))
        wide = x.mT if shape[0] > shape[1] else x
        u, _, vh = torch.linalg.svd(wide.double(), full_matrices=False)
        distance = {}
        for method in NS_METHODS:
            plan, safety = iteration_plan(method)
            distance[method] = (newton_schulz(wide.to(dtype), plan, safety).double() - u @ vh).norm(dim=(-2, -1))
        assert (distance["polar_express"] <= distance["quintic"]).all(), (shape, distance)


def test_polar_express_is_five_published_tuples_and_the_quintic_torchs_one_repeated():
    plan, safety = iteration_plan("polar_express")
    assert len(plan) == 5 and len(set(plan)) == 5 and safety == 1.01
    assert plan[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert iteration_plan("quintic") == ((NS_COEFFICIENTS,) * 5, 1.0)
    with pytest.raises(ValueError, match="one of"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_method="cubic")


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


# ---------------------------------------------------------------------------- cautious weight decay
def test_cautious_decay_only_where_the_update_and_the_weight_agree_in_sign():
    """Zero gradients give O = 0, whose sign agrees with no weight: cautious decay leaves every
    weight be, where the plain decay shrinks them all. Then a hand-made case of the mask."""
    from trainer.weight_decay import decay_

    for cautious, shrunk in [(False, True), (True, False)]:
        params = [torch.nn.Parameter(m) for m in matrices((8, 16))]
        start = params[0].detach().clone()
        params[0].grad = torch.zeros(8, 16)
        Muon(params, lr=0.1, weight_decay=0.5, cautious_wd=cautious).step()
        assert torch.equal(params[0], start * (1 - 0.05)) if shrunk else torch.equal(params[0], start)
    weight = torch.tensor([[1.0, -2.0], [3.0, -4.0]])
    decay_([weight], 0.25, [torch.tensor([[0.5, 0.5], [-1.0, -1.0]])])  # agree, differ; differ, agree
    assert torch.equal(weight, torch.tensor([[0.75, -2.0], [3.0, -3.0]]))
