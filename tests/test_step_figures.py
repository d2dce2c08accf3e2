"""trainer/step.py's loss and figures by name: training_loss assembles what a step trains on,
each named part is summed over the ranks in the step's one all-reduce, and the totals and the
log line take every name there is, so that a new logged term is a line in step.py; the step's
gradient norm, before clipping, is logged beside them."""
import json
from contextlib import nullcontext

import pytest
import torch

import trainer.step as step_module
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, MiniMindOutput
from trainer.loop import TrainClock
from trainer.metrics import RunLogger
from trainer.step import PER_MICRO_BATCH, PER_TOKEN, StepResult, StepTotals, TrainParts, optimizer_step, training_loss
from trainer.train_state import StepPlan, TrainState


def test_the_training_loss_is_the_cross_entropy_plus_the_micro_batches_mean_aux_loss():
    out = MiniMindOutput(loss=torch.tensor(2.0), aux_loss=torch.tensor(0.3))
    total, parts = training_loss(out, accum=3)
    assert total.item() == pytest.approx(2.1)
    assert parts == {"loss": out.loss, "aux_loss": out.aux_loss}


def one_step(world_size: int):
    """One step of a tiny MoE model (an aux loss that is not 0) at `world_size`, whose other ranks
    are this one's copies: the all-reduce multiplies by the world size, as summing copies would."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512, use_moe=True))
    parts = TrainParts(model, model, torch.optim.SGD(model.parameters(), lr=0.1),
                       torch.amp.GradScaler("cpu", enabled=False), nullcontext(), torch.device("cpu"), world_size)
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, dims=1)
    targets[1, 10:] = -100
    return optimizer_step(parts, [(ids[:1], targets[:1]), (ids[1:], targets[1:])])


def test_each_named_figure_is_summed_over_the_ranks(monkeypatch):
    one = one_step(1)
    monkeypatch.setattr(step_module, "all_reduce_sum", lambda t: t.mul_(2))
    two = one_step(2)
    assert set(one.figures) == {"tokens", "grad_norm", "finite_norms", *step_module.AVERAGED}
    assert one.figures["tokens"].item() == 16 + 10 and two.figures["tokens"].item() == 2 * (16 + 10)
    # per token: the sum over every rank's tokens; per micro-batch: the mean over the ranks
    assert two.figures["loss"].item() == 2 * one.figures["loss"].item()
    assert two.figures["aux_loss"].item() == one.figures["aux_loss"].item() > 0
    assert two.mean_loss() == one.mean_loss() == pytest.approx(one.figures["loss"].item() / 26)


def result(**figures) -> StepResult:
    return StepResult({name: torch.tensor(value, dtype=torch.float64) for name, value in figures.items()},
                      skipped=False, stop=False, save=False)


def test_a_new_part_is_one_entry_and_reaches_the_totals_and_the_log_row_and_line(tmp_path, monkeypatch, capsys):
    """A z-loss entered in AVERAGED alone is averaged over the window, and written in the metrics
    row and the log line under its name, beside the loss, the aux loss and the gradient norm, whose
    mean leaves out a step fp16's scaler skipped (no finite norm)."""
    monkeypatch.setitem(step_module.AVERAGED, "z_loss", PER_TOKEN)
    assert step_module.AVERAGED["aux_loss"] == PER_MICRO_BATCH
    totals = StepTotals(torch.device("cpu"))
    totals.add(result(tokens=100, grad_norm=3.0, finite_norms=1.0, loss=250.0, aux_loss=0.5, z_loss=10.0))
    totals.add(result(tokens=300, grad_norm=1.0, finite_norms=1.0, loss=550.0, aux_loss=0.25, z_loss=30.0))
    totals.add(result(tokens=0, grad_norm=0.0, finite_norms=0.0, loss=0.0, aux_loss=0.0, z_loss=0.0))  # fp16's overflow
    window = totals.take_window()
    # (250 + 550) / 400, (0.5 + 0.25 + 0) / 3, (10 + 30) / 400; the finite gradient norms' mean: (3 + 1) / 2
    assert window == {"loss": 2.0, "aux_loss": 0.25, "z_loss": 0.1, "grad_norm": 2.0}
    empty = totals.take_window()
    assert set(empty) == set(window) and all(v != v for v in empty.values())  # NaN, not 0 / 0
    totals.add(result(tokens=0, grad_norm=1.0, finite_norms=1.0, loss=0.0, aux_loss=0.5, z_loss=0.0))  # no reply left
    no_tokens = totals.take_window()
    assert no_tokens["loss"] != no_tokens["loss"] and no_tokens["aux_loss"] == 0.5 and no_tokens["grad_norm"] == 1.0

    output = type("Output", (), {"save_dir": str(tmp_path), "from_resume": 0, "use_wandb": False})
    log = RunLogger(str(tmp_path / "metrics.jsonl"), output, "p", TrainState(StepPlan(4, 1, 1, 10, 10)), {}, True,
                    TrainClock())
    log.log_train(2, 0, window, {"decay": 1e-3}, 400, 1000.0, 900.0, None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: row[k] for k in window} == window
    assert "loss 2.0000 aux_loss 0.2500 z_loss 0.1000 grad_norm 2.0000 lr decay=1.00e-03" in capsys.readouterr().out


def tiny_step_parts(model, scaler=None) -> TrainParts:
    return TrainParts(model, model, torch.optim.SGD(model.parameters(), lr=1.0),
                      scaler or torch.amp.GradScaler("cpu", enabled=False), nullcontext(), torch.device("cpu"), 1)


def test_the_gradient_norm_is_the_global_norm_before_clipping():
    """The step's grad_norm is the norm of all gradients of its loss, measured before --grad_clip
    scales them: here 0.01, far below it, and the update is the clipped one."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512))
    twin = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512))
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, dims=1)
    twin(ids, shift_labels=targets).loss.backward()
    grads = [p.grad.clone() for p in twin.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    before = [p.detach().clone() for p in model.parameters()]
    step = optimizer_step(tiny_step_parts(model), [(ids, targets)], grad_clip=0.01)
    assert step.figures["grad_norm"].item() == pytest.approx(norm, rel=1e-5) and norm > 0.01
    assert step.figures["finite_norms"].item() == 1
    # SGD at lr 1: each weight moved by its gradient scaled to the clipped norm
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(b - p.detach(), g * (0.01 / norm), rtol=1e-4, atol=1e-7)


def test_a_step_the_loss_scaler_skips_has_no_finite_norm():
    """A loss scale so large that the gradients overflow: the scaler skips the update, the step is
    not marked skipped (its loss is finite), and its inf norm is kept out of the log's mean."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512))
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    step = optimizer_step(tiny_step_parts(model, torch.amp.GradScaler("cpu", init_scale=1e38)),
                          [(ids, ids.roll(-1, dims=1))], grad_clip=1.0)
    assert not step.skipped
    assert (step.figures["grad_norm"].item(), step.figures["finite_norms"].item()) == (0.0, 0.0)
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
