"""trainer/optim.py and trainer/schedule.py: parameter groups, the per-group schedule (the table
of schedules by name) and the optim group's flags. (Muon itself is tests/test_muon.py's,
--optimizer auto tests/test_auto.py's, bits per byte tests/test_bits_per_byte.py's.)"""
import math

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.config import TrainConfig, parse_config
from trainer.optim import build_optimizer, describe, param_groups, set_lr


def tiny_model(**kw):
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512, **kw))


def optim(**values):
    """The config's optim group with every auto decided: AdamW at 3e-3 with weight decay 0.01 and betas
    0.9,0.95, the cosine, Muon at 0.02 with 5 Newton-Schulz steps, without NorMuon."""
    resolved = {"optimizer": "adamw", "lr_schedule": "cosine", "normuon": 0, "muon_lr": 0.02, "learning_rate": 3e-3,
                "weight_decay": 0.01, "muon_ns_steps": 5, "adam_betas": (0.9, 0.95)}
    return TrainConfig.of(**{**resolved, **values}).optim


# ---------------------------------------------------------------------------- parameter groups
def _groups(model, optimizer="adamw", groups="split", weight_decay=0.01):
    return {g["name"]: g for g in param_groups(model, optimizer, groups, weight_decay)}


def test_no_weight_decay_on_norms_and_other_1d_params():
    model = tiny_model()
    groups = _groups(model)
    assert set(groups) == {"decay", "no_decay"}
    assert groups["no_decay"]["weight_decay"] == 0 and groups["decay"]["weight_decay"] > 0
    assert all(p.ndim == 1 for p in groups["no_decay"]["params"])
    assert all(p.ndim == 2 for p in groups["decay"]["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("norm" in names[id(p)] for p in groups["no_decay"]["params"])
    # Every parameter exactly once (the tied embedding / lm_head is one tensor).
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())


def test_decay_really_skips_1d_params():
    """Zero gradients: only weight decay moves a parameter."""
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, optim(learning_rate=0.1, weight_decay=0.5))
    for group in opt.param_groups:
        group["lr"] = 0.1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (p.ndim == 1), n


def test_minimind_single_group_and_muon_split():
    model = tiny_model()
    single = _groups(model, groups="single")
    assert list(single) == ["all"] and single["all"]["weight_decay"] == 0.01
    muon = _groups(model, optimizer="muon")
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and ".layers." in f".{names[id(p)]}" for p in muon["muon"]["params"])
    assert [names[id(p)] for p in muon["decay"]["params"]] == ["model.embed_tokens.weight"]  # = the tied head
    opt = build_optimizer(model, optim(optimizer="muon"))
    assert [type(o).__module__ + "." + type(o).__name__ for o in opt] == ["torch.optim.adamw.AdamW",
                                                                          "trainer.optim.Muon"]
    assert opt[0].defaults["fused"] is True


def test_each_group_follows_its_own_schedule_and_the_config_wins_on_resume():
    model = tiny_model()
    cfg = optim(optimizer="muon", learning_rate=3e-3, muon_lr=0.02, warmup_steps=10)
    opt = build_optimizer(model, cfg)
    assert set_lr(opt, cfg, step=0, total_steps=100) == pytest.approx({"muon": 0.002, "decay": 3e-4, "no_decay": 3e-4})
    assert set_lr(opt, cfg, step=10, total_steps=100) == pytest.approx({"muon": 0.02, "decay": 3e-3, "no_decay": 3e-3})
    # A checkpoint's param groups carry the old lr; the next set_lr follows this run's peaks.
    saved = [o.state_dict() for o in opt]
    new_cfg = optim(optimizer="muon", learning_rate=1e-3, muon_lr=0.01, warmup_steps=10)
    fresh = build_optimizer(model, new_cfg)
    for o, state in zip(fresh, saved):
        o.load_state_dict(state)
    assert set_lr(fresh, new_cfg, 10, 100) == pytest.approx({"muon": 0.01, "decay": 1e-3, "no_decay": 1e-3})


def test_a_resume_loads_the_optimizers_state_and_keeps_this_runs_hyperparameters(tmp_path):
    """The saved param groups carry the saved run's weight decay, betas and Newton-Schulz steps;
    the resume (ModelState, the trainer's loader) takes the moments and buffers from them, and the
    values this run's config built the optimizer with, where a flag typed on resume put them."""
    from trainer.train_state import ModelState

    before = optim(optimizer="muon", weight_decay=0.3, adam_betas=(0.9, 0.95), muon_ns_steps=5)
    model = tiny_model()
    opt = build_optimizer(model, before)
    ids = torch.randint(3, 512, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    saved = ModelState(model, opt).state_dict()

    after = optim(optimizer="muon", weight_decay=0.1, adam_betas=(0.8, 0.99), muon_ns_steps=3)
    fresh_model = tiny_model()
    fresh = build_optimizer(fresh_model, after)
    ModelState(fresh_model, fresh).load_state_dict({"path": str(tmp_path / "saved.pth"), **saved})
    groups = {g["name"]: g for g in fresh.param_groups}
    assert (groups["decay"]["weight_decay"], groups["muon"]["weight_decay"], groups["no_decay"]["weight_decay"]) \
        == (0.1, 0.1, 0.0)
    assert groups["decay"]["betas"] == groups["no_decay"]["betas"] == (0.8, 0.99)
    assert groups["muon"]["ns_steps"] == 3
    names = {p: n for n, p in model.named_parameters()}
    fresh_params = dict(fresh_model.named_parameters())
    for p, state in opt.state.items():
        for key, value in state.items():
            assert torch.equal(fresh.state[fresh_params[names[p]]][key], value), f"{names[p]}: {key} not loaded"


def test_wsd_and_cosine_hand_computed():
    """Peak 1, 100 steps, 10 of warmup. WSD with cooldown 0.2 and floor 0.1: warmup (step + 1) / 10,
    the peak to step 80, then linear: step 90 is half-way, 1 - 0.9 * 0.5 = 0.55; step 99 is
    1 - 0.9 * 19 / 20 = 0.145; the floor at step 100. Cosine with floor 0.2: half-way through
    its 90 decaying steps (step 55) 0.2 + 0.8 * 0.5 = 0.6."""
    from trainer.schedule import cosine_lr, wsd_lr

    by_step = {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 80: 1.0, 90: 0.55, 99: 0.145, 100: 0.1}
    assert {step: wsd_lr(step, 100, 1.0, 10, 0.2, 0.1) for step in by_step} == pytest.approx(by_step)
    assert [cosine_lr(step, 100, 1.0, 10, 0.2) for step in (9, 10, 55, 100)] == pytest.approx([1.0, 1.0, 0.6, 0.2])
    # The cooldown never starts inside the warmup: 10 steps, 5 of warmup, cooldown 0.9 -> from step 5.
    assert [wsd_lr(step, 10, 1.0, 5, 0.9, 0.1) for step in (4, 5, 7)] == pytest.approx([1.0, 1.0, 1 - 0.9 * 2 / 5])
    # set_lr takes the config's kind, warmup, cooldown and floor
    cfg = optim(lr_schedule="wsd", learning_rate=1.0, warmup_steps=10, min_lr_frac=0.1)
    opt = build_optimizer(tiny_model(), cfg)
    assert set_lr(opt, cfg, 90, 100)["decay"] == pytest.approx(0.55)


def test_the_cosine_schedule_is_minimind_get_lr():
    """get_lr (trainer_utils.py's name for cosine_lr) is MiniMind's formula to float rounding, and
    --min_lr_frac 0.1 is its floor: --lr_schedule cosine, at the other defaults, is get_lr's to
    the bit, for every group from its own peak."""
    from trainer.trainer_utils import get_lr

    def minimind_get_lr(current_step, total_steps, lr):  # MiniMind's trainer/trainer_utils.py
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * current_step / total_steps)))
    for step in (0, 21, 50, 99, 100):
        assert get_lr(step, 100, 5e-4) == pytest.approx(minimind_get_lr(step, 100, 5e-4), rel=1e-15, abs=0)

    cfg = optim(optimizer="muon", lr_schedule="cosine")
    assert (cfg.min_lr_frac, cfg.learning_rate, cfg.warmup_steps) == (0.1, 3e-3, 10)
    opt = build_optimizer(tiny_model(), cfg)
    for step in (0, 5, 10, 37, 99, 100):
        lrs = set_lr(opt, cfg, step, 100)
        assert lrs["decay"] == get_lr(step, 100, 3e-3, 10) and lrs["muon"] == get_lr(step, 100, 0.02, 10)


def test_the_flag_offers_the_tables_schedules_and_nothing_else(capsys):
    """--lr_schedule's choices are SCHEDULES' names and auto; another name stops the parser in one line."""
    from trainer.config import build_parser
    from trainer.schedule import SCHEDULES

    flag = next(a for a in build_parser()._actions if "--lr_schedule" in a.option_strings)
    assert tuple(flag.choices) == ("auto", *SCHEDULES) and {"cosine", "wsd"} <= set(SCHEDULES)
    with pytest.raises(SystemExit):
        parse_config(["--lr_schedule", "none_such"])
    error = capsys.readouterr().err
    assert "--lr_schedule: invalid choice: 'none_such'" in error and error.count("\n") == 1


def test_set_lr_takes_the_schedule_from_the_table_and_refuses_an_unknown_name(monkeypatch):
    """A config built in code bypasses the parser: an unknown (or unresolved auto) schedule is a
    one-line UserError, never a silent cosine; an entry added to the table is followed as it is."""
    from common.errors import UserError
    from trainer import schedule

    opt = build_optimizer(tiny_model(), optim())
    for name in ("none_such", "auto"):
        with pytest.raises(UserError) as info:
            set_lr(opt, optim(lr_schedule=name), 0, 100)
        assert str(info.value) == f"--lr_schedule {name}: no such schedule (one of {', '.join(schedule.SCHEDULES)})"
    monkeypatch.setitem(schedule.SCHEDULES, "half", lambda step, total, lr, optim: lr / 2)
    assert set_lr(opt, optim(lr_schedule="half", learning_rate=1e-3), 7, 100) == {"decay": 5e-4, "no_decay": 5e-4}


def test_the_start_up_line_names_each_group_and_the_schedule():
    cfg = optim(optimizer="muon", normuon=1, lr_schedule="wsd")
    line = describe(build_optimizer(tiny_model(), cfg), cfg)
    assert line.startswith("optimizer: decay (AdamW, 0.03M params, lr 3.0e-03, wd 0.01); ")
    assert "muon (Muon, " in line and ", 5 Newton-Schulz steps)" in line and "NorMuon (beta2 0.95)" in line
    assert line.endswith("lr schedule wsd (10 warmup steps, cooldown over the last 20%, floor 0.1 of each peak)")


@pytest.mark.parametrize("flags, message", [
    (["--cooldown_frac", "1.5"], "--cooldown_frac must be in [0, 1] (the share of the run"),
    (["--min_lr_frac", "-0.1"], "--min_lr_frac must be in [0, 1] (the lr floor"),
    (["--min_lr_frac", "nan"], "--min_lr_frac must be in [0, 1]"),
    (["--optimizer", "adamw", "--normuon", "1"], "--normuon 1 changes Muon's update, and --optimizer adamw"),
    (["--optimizer", "muon", "--param_groups", "single"], "--param_groups single is MiniMind's"),
])
def test_a_bad_option_is_one_line_naming_its_flag(flags, message):
    from common.errors import UserError
    from model.model_minimind import MiniMindConfig
    from trainer.auto import resolve_auto
    from trainer.config import check_config

    def settle(flags):  # resume_config.py's settle_config, without a resume: parse, resolve auto, check
        cfg, typed = parse_config(flags)
        cfg = resolve_auto(cfg, dict.fromkeys(typed, "typed"), torch.device("cpu"), False,
                           MiniMindConfig(hidden_size=64, num_hidden_layers=2), 4 * 64)
        check_config(cfg)

    with pytest.raises(UserError) as info:
        settle(flags)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    settle(["--optimizer", "adamw", "--lr_schedule", "wsd"])  # what adamw can use passes


def test_adam_betas_reach_adamw_and_a_bad_pair_is_one_line(capsys):
    cfg = parse_config(["--adam_betas", "0.9,0.999"])[0].replace(optimizer="muon", muon_lr=0.02, normuon=0,
                                                                  learning_rate=3e-3)
    adamw = build_optimizer(tiny_model(), cfg.optim)[0]
    assert adamw.defaults["betas"] == (0.9, 0.999)
    assert parse_config([])[0].optim.adam_betas == "auto"  # decided by the optimizer (tests/test_auto.py)
    with pytest.raises(SystemExit) as info:
        parse_config(["--adam_betas", "0.9"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "--adam_betas: expected two numbers in [0, 1) as B1,B2" in err
