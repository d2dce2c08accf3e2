"""trainer/optim.py: parameter groups and the per-group schedule; dataset/token_bytes.py:
bits per byte. (Muon itself is tests/test_muon.py's, --optimizer auto tests/test_settings.py's.)"""
import math

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.launching import REPO_ROOT
from trainer.optim import OptimConfig, build_optimizer, param_groups, peak_lrs, set_lr

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
    cfg = OptimConfig(optimizer="muon", lr=3e-3, muon_lr=0.02)
    opt = build_optimizer(model, cfg)
    lrs = set_lr(opt, peak_lrs(cfg), step=0, total_steps=100, warmup_steps=10)
    assert lrs == pytest.approx({"muon": 0.002, "decay": 3e-4, "no_decay": 3e-4})
    lrs = set_lr(opt, peak_lrs(cfg), step=10, total_steps=100, warmup_steps=10)
    assert lrs == pytest.approx({"muon": 0.02, "decay": 3e-3, "no_decay": 3e-3})
    # A checkpoint's param groups carry the old lr; the next set_lr follows this run's peaks.
    saved = opt.state_dict()
    new_cfg = OptimConfig(optimizer="muon", lr=1e-3, muon_lr=0.01)
    fresh = build_optimizer(model, new_cfg)
    fresh.load_state_dict(saved)
    assert set_lr(fresh, peak_lrs(new_cfg), 10, 100, 10) == pytest.approx({"muon": 0.01, "decay": 1e-3,
                                                                           "no_decay": 1e-3})


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
    cfg = OptimConfig.from_args(args, RunSettings("float32", "muon", False), torch.device("cpu"))
    adamw = build_optimizer(tiny_model(), cfg).optimizers[0]
    assert adamw.defaults["betas"] == (0.9, 0.999)
    assert parse_args([]).adam_betas == (0.9, 0.95)
    with pytest.raises(SystemExit) as info:
        parse_args(["--adam_betas", "0.9"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "--adam_betas: expected two numbers in [0, 1) as B1,B2" in err
