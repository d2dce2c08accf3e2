"""trainer/optim.py: parameter groups, the per-group schedule (cosine or WSD, Muon's momentum
warmup, lrs by width), trainer/adamw.py's AdamW for cautious decay and the options' flags;
dataset/token_bytes.py: bits per byte. (Muon itself is tests/test_muon.py's, --optimizer auto
tests/test_settings.py's.)"""
import math

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.launching import REPO_ROOT
from trainer.optim import OptimConfig, Schedule, build_optimizer, param_groups, set_lr

def tiny_model(**kw):
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512, **kw))


# ---------------------------------------------------------------------------- parameter groups
def _groups(model, **cfg):
    return {g["name"]: g for g in param_groups(model, OptimConfig(**cfg))}


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
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (p.ndim == 1), n


def test_minimind_single_group_and_muon_split():
    model = tiny_model()
    single = _groups(model, param_groups="single")
    assert list(single) == ["all"] and single["all"]["weight_decay"] == 0.01
    muon = _groups(model, optimizer="muon")
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and ".layers." in f".{names[id(p)]}" for p in muon["muon"]["params"])
    assert [names[id(p)] for p in muon["decay"]["params"]] == ["model.embed_tokens.weight"]  # = the tied head
    opt = build_optimizer(model, OptimConfig(optimizer="muon"))
    assert [type(o).__module__ + "." + type(o).__name__ for o in opt] == ["torch.optim.adamw.AdamW",
                                                                          "trainer.muon.Muon"]
    assert opt.optimizers[0].defaults["fused"] is True


def test_each_group_follows_its_own_schedule_and_the_flags_win_on_resume():
    model = tiny_model()
    cfg = OptimConfig(optimizer="muon", lr=3e-3, muon_lr=0.02, warmup_steps=10)
    opt = build_optimizer(model, cfg)
    lrs = set_lr(opt, Schedule.of(cfg), step=0, total_steps=100)
    assert lrs == pytest.approx({"muon": 0.002, "decay": 3e-4, "no_decay": 3e-4})
    lrs = set_lr(opt, Schedule.of(cfg), step=10, total_steps=100)
    assert lrs == pytest.approx({"muon": 0.02, "decay": 3e-3, "no_decay": 3e-3})
    # A checkpoint's param groups carry the old lr; the next set_lr follows this run's peaks.
    saved = opt.state_dict()
    new_cfg = OptimConfig(optimizer="muon", lr=1e-3, muon_lr=0.01, warmup_steps=10)
    fresh = build_optimizer(model, new_cfg)
    fresh.load_state_dict(saved)
    assert set_lr(fresh, Schedule.of(new_cfg), 10, 100) == pytest.approx({"muon": 0.01, "decay": 1e-3,
                                                                          "no_decay": 1e-3})


def test_wsd_and_cosine_hand_computed():
    """Peak 1, 100 steps, 10 of warmup. WSD with cooldown 0.2 and floor 0.1: warmup (step + 1) / 10,
    the peak to step 80, then linear: step 90 is half-way, 1 - 0.9 * 0.5 = 0.55; step 99 is
    1 - 0.9 * 19 / 20 = 0.145; the floor at step 100. Cosine with floor 0.2: half-way through
    its 90 decaying steps (step 55) 0.2 + 0.8 * 0.5 = 0.6."""
    wsd = Schedule({"decay": 1.0}, warmup_steps=10, kind="wsd", cooldown_frac=0.2, min_lr_frac=0.1)
    by_step = {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 80: 1.0, 90: 0.55, 99: 0.145, 100: 0.1}
    assert {step: wsd.lr("decay", step, 100) for step in by_step} == pytest.approx(by_step)
    cosine = Schedule({"decay": 1.0}, warmup_steps=10, min_lr_frac=0.2)
    assert [cosine.lr("decay", step, 100) for step in (9, 10, 55, 100)] == pytest.approx([1.0, 1.0, 0.6, 0.2])
    # The cooldown never starts inside the warmup: 10 steps, 5 of warmup, cooldown 0.9 -> from step 5.
    short = Schedule({"decay": 1.0}, warmup_steps=5, kind="wsd", cooldown_frac=0.9, min_lr_frac=0.1)
    assert [short.lr("decay", step, 10) for step in (4, 5, 7)] == pytest.approx([1.0, 1.0, 1 - 0.9 * 2 / 5])


def test_the_cosine_schedule_is_minimind_get_lr():
    """--min_lr_frac 0.1 is get_lr's own floor: --lr_schedule cosine, at the other defaults, is
    get_lr's to the bit."""
    from trainer.args import parse_args
    from trainer.optim import get_lr
    from trainer.settings import RunSettings

    cfg = OptimConfig.from_args(parse_args(["--lr_schedule", "cosine"]), RunSettings("float32", "muon", False, "cosine"),
                                torch.device("cpu"), 512)
    schedule = Schedule.of(cfg)
    assert (schedule.kind, schedule.min_lr_frac, schedule.momentum_warmup) == ("cosine", 0.1, 0)
    for step in (0, 5, 10, 37, 99, 100):
        assert schedule.lr("decay", step, 100) == get_lr(step, 100, 3e-3, 10)
        assert schedule.lr("muon", step, 100) == get_lr(step, 100, 0.02, 10)


def test_muon_momentum_warms_up_from_0_85_and_set_lr_writes_it():
    """0.85 at step 0, half-way (0.90) at 150 of 300 steps, 0.95 from step 300; without a warmup
    the flag's value from step 0. set_lr writes it into Muon's group each step, over whatever a
    checkpoint restored there."""
    from trainer.optim import muon_momentum

    assert [muon_momentum(step, 0.95, 300) for step in (0, 150, 300, 1000)] == pytest.approx([0.85, 0.9, 0.95, 0.95])
    assert muon_momentum(0, 0.95, 0) == 0.95
    cfg = OptimConfig(optimizer="muon", muon_momentum=0.95, muon_momentum_warmup=300)
    opt = build_optimizer(tiny_model(), cfg)
    muon_group = next(g for g in opt.param_groups if g["name"] == "muon")
    muon_group["momentum"] = 0.5  # as a checkpoint of another run would leave it
    set_lr(opt, Schedule.of(cfg), step=150, total_steps=1000)
    assert muon_group["momentum"] == pytest.approx(0.9)
    assert all("momentum" not in g for g in opt.param_groups if g["name"] != "muon")


def test_lr_ref_width_scales_the_adamw_peaks_by_the_root_of_the_width_ratio():
    """Hidden 1024 at reference 256: x (1024 / 256) ** -0.5 = x0.5 for the AdamW groups, Muon's
    peak as it was; off, the peaks are the flags' to the bit. The start-up line says it."""
    from trainer.optim import describe, peak_lrs

    cfg = OptimConfig(optimizer="muon", lr=3e-3, muon_lr=0.02, lr_ref_width=256, hidden_size=1024)
    assert peak_lrs(cfg) == pytest.approx({"muon": 0.02, "decay": 1.5e-3, "no_decay": 1.5e-3, "all": 1.5e-3})
    assert peak_lrs(OptimConfig(lr=3e-3, hidden_size=1024))["decay"] == 3e-3
    line = describe(build_optimizer(tiny_model(), cfg), cfg)
    assert "decay (AdamW, 0.03M params, lr 1.5e-03, wd 0.01)" in line
    assert line.endswith("; AdamW peaks x0.500 = (1024 / 256) ** -0.5 (--lr_ref_width)")
    assert "**" not in describe(build_optimizer(tiny_model(), OptimConfig()), OptimConfig())


# ---------------------------------------------------------------------------- AdamW, cautious
def test_our_adamw_is_torchs_and_loads_its_state():
    """trainer/adamw.py without cautious decay: torch.optim.AdamW's update to float noise over
    three steps, and the same state, so either loads the other's."""
    from trainer.adamw import AdamW

    ours_model, torch_model = tiny_model(), tiny_model()
    ours = AdamW(ours_model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    theirs = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    for step in range(3):
        torch.manual_seed(step)
        for p, q in zip(ours_model.parameters(), torch_model.parameters()):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    saved = theirs.state_dict()
    assert ours.state_dict()["state"][0].keys() == saved["state"][0].keys()
    ours.load_state_dict(saved)
    assert torch.equal(ours.state[next(ours_model.parameters())]["exp_avg"], saved["state"][0]["exp_avg"])


def test_cautious_adamw_hand_computed():
    """Adam's first update is g / (|g| + eps), about sign(g). Weights [1, -1, 2, -2], gradients
    [1, 1, -1, -1]: the update agrees in sign with the first and last weights only, so with lr
    0.1 and decay 0.5 (rate 0.05) those are decayed: 1 - 0.1 - 0.05, -1 - 0.1, 2 + 0.1, -2 + 0.1 + 0.1."""
    from trainer.adamw import AdamW

    weight = torch.nn.Parameter(torch.tensor([1.0, -1.0, 2.0, -2.0]))
    weight.grad = torch.tensor([1.0, 1.0, -1.0, -1.0])
    AdamW([weight], lr=0.1, weight_decay=0.5, cautious_wd=True).step()
    torch.testing.assert_close(weight.detach(), torch.tensor([0.85, -1.1, 2.1, -1.8]))


@pytest.mark.parametrize("cautious, adamw_class, muon_cautious", [
    ("none", "torch.optim.adamw.AdamW", False), ("muon", "torch.optim.adamw.AdamW", True),
    ("adamw", "trainer.adamw.AdamW", False), ("both", "trainer.adamw.AdamW", True)])
def test_cautious_wd_picks_the_optimizers(cautious, adamw_class, muon_cautious):
    adamw, muon = build_optimizer(tiny_model(), OptimConfig(optimizer="muon", cautious_wd=cautious))
    assert f"{type(adamw).__module__}.{type(adamw).__name__}" == adamw_class
    assert muon.cautious_wd is muon_cautious


@pytest.mark.parametrize("flags, message", [
    (["--normuon_beta2", "1"], "--normuon_beta2 must be in [0, 1) (NorMuon's decay"),
    (["--cooldown_frac", "1.5"], "--cooldown_frac must be in [0, 1] (the share of the run"),
    (["--min_lr_frac", "-0.1"], "--min_lr_frac must be in [0, 1] (the lr floor"),
    (["--min_lr_frac", "nan"], "--min_lr_frac must be in [0, 1]"),
    (["--muon_momentum_warmup", "-1"], "--muon_momentum_warmup must be at least 0, got -1"),
    (["--lr_ref_width", "-256"], "--lr_ref_width must be at least 0, got -256"),
    (["--optimizer", "adamw", "--normuon", "1"], "--normuon 1 changes Muon's update, and --optimizer adamw"),
    (["--optimizer", "adamw", "--cautious_wd", "both"], "--cautious_wd both changes Muon's update"),
])
def test_a_bad_option_is_one_line_naming_its_flag(flags, message):
    from common.errors import UserError
    from trainer.args import check_args, parse_args

    with pytest.raises(UserError) as info:
        check_args(parse_args(flags), torch.device("cpu"))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    check_args(parse_args(["--optimizer", "adamw", "--cautious_wd", "adamw", "--lr_schedule", "wsd"]),
               torch.device("cpu"))  # what adamw can use passes


# ---------------------------------------------------------------------------- bits per byte
def test_token_byte_lengths_spell_the_utf8_text():
    from dataset.lm_dataset import load_tokenizer
    from dataset.token_bytes import token_byte_lengths

    tok = load_tokenizer(REPO_ROOT / "model")
    lengths = token_byte_lengths(tok, 6400)
    assert lengths[[tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]].tolist() == [0, 0, 0]
    for text in ["héllo wörld", "def f(x):\n    return x", "你好，世界！ 🙂"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert lengths[ids].sum().item() == len(text.encode("utf-8"))


def test_bits_per_byte_hand_computed():
    """A model with zero logits predicts uniformly: every scored target costs ln(V) nats.
    "héllo" is 6 UTF-8 bytes; the targets are its tokens and the EOS (the EOS counts its
    NLL, 0 bytes), so bits/byte = (tokens + 1) * log2(V) / 6."""
    from contextlib import nullcontext

    from dataset.lm_dataset import load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from trainer.loop import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400))
    torch.nn.init.zeros_(model.lm_head.weight)  # tied: the embedding too, so every logit is 0
    text = "héllo"
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
    x = torch.tensor([ids + [tok.pad_token_id] * 3])
    targets = torch.tensor([ids[1:] + [-100] * 4])  # next-token targets: what every loader yields
    loss, bpb = evaluate(model, [(x, targets)], nullcontext(), "cpu", token_byte_lengths(tok, 6400))
    n_targets = len(ids) - 1
    assert loss == pytest.approx(math.log(6400), rel=1e-5)
    assert bpb == pytest.approx(n_targets * math.log2(6400) / 6, rel=1e-5)


def test_eval_llm_and_trainer_validation_agree_on_bits_per_byte(tmp_path):
    """The same documents scored by scripts/eval_llm.py and by the trainer's evaluate()."""
    import json
    from contextlib import nullcontext

    from torch.utils.data import DataLoader

    from dataset.lm_dataset import NextTokenTargets, PretrainDataset, load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from scripts.eval_llm import perplexity
    from trainer.loop import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    docs = tmp_path / "val.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                            ["Return the value.", "Ünïcödé text 你好", "x = 1\ny = 2\n" * 3]))
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400)).eval()
    _, _, loss, bpb = perplexity(model, tok, docs, max_seq_len=64)
    loader = DataLoader(NextTokenTargets(PretrainDataset(str(docs), tok, 64)), batch_size=2)
    loss_t, bpb_t = evaluate(model, loader, nullcontext(), "cpu", token_byte_lengths(tok, 6400))
    assert bpb_t == pytest.approx(bpb, rel=1e-5) and loss_t == pytest.approx(loss, rel=1e-5)


def test_adam_betas_reach_adamw_and_a_bad_pair_is_one_line(capsys):
    from trainer.args import parse_args
    from trainer.settings import RunSettings

    args = parse_args(["--adam_betas", "0.9,0.999"])
    cfg = OptimConfig.from_args(args, RunSettings("float32", "muon", False), torch.device("cpu"), 64)
    adamw = build_optimizer(tiny_model(), cfg).optimizers[0]
    assert adamw.defaults["betas"] == (0.9, 0.999)
    assert parse_args([]).adam_betas == (0.9, 0.95)
    with pytest.raises(SystemExit) as info:
        parse_args(["--adam_betas", "0.9"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "--adam_betas: expected two numbers in [0, 1) as B1,B2" in err
