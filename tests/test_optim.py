"""trainer/optim.py: the auto dtype, parameter groups, Muon under DDP/FSDP and exact
resume with Muon, the per-group schedule; dataset/token_bytes.py: bits per byte."""
import math
import runpy
import sys

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.fault_helpers import assert_clean_exit
from tests.forked_ranks import train_forked
from tests.launch_utils import (
    REPO_ROOT, TINY, assert_bitwise_equal, latest_checkpoint, out_args, run_in_process, train_in_process,
)
from trainer import optim
from trainer.optim import OptimConfig, build_optimizer, param_groups, peak_lrs, resolve_dtype, set_lr

AMX_XEON = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16_ONLY = frozenset({"avx2", "avx512f", "avx512_bf16"})
EPYC_NO_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512bw"})


def tiny_model(**kw):
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512, **kw))


# ---------------------------------------------------------------------------- dtype
@pytest.mark.parametrize("flag, device, cpu_flags, cuda_bf16, sharded, expected", [
    ("auto", "cpu", AMX_XEON, False, False, "bfloat16"),
    ("auto", "cpu", AVX512_BF16_ONLY, False, False, "bfloat16"),
    ("auto", "cpu", EPYC_NO_BF16, False, False, "float32"),
    ("auto", "cpu", frozenset(), False, False, "float32"),
    ("auto", "cuda:0", frozenset(), True, False, "bfloat16"),
    ("auto", "cuda:1", frozenset(), False, False, "float16"),
    ("auto", "cuda", frozenset(), False, True, "float32"),  # FSDP: no sharded GradScaler
    ("float32", "cuda:0", frozenset(), True, False, "float32"),
    ("bfloat16", "cpu", EPYC_NO_BF16, False, False, "bfloat16"),
])
def test_resolve_dtype(flag, device, cpu_flags, cuda_bf16, sharded, expected):
    name, why = resolve_dtype(flag, device, cpu_flags, cuda_bf16, sharded)
    assert name == expected
    assert why


@pytest.mark.parametrize("flag, device, cpu_flags, cuda_bf16, groups, has_muon, expected", [
    ("auto", "cuda:0", frozenset(), True, "split", True, "muon"),
    ("auto", "cuda:0", frozenset(), False, "split", True, "adamw"),  # a T4: Muon's bf16 is emulated
    ("auto", "cpu", frozenset({"avx512f", "amx_bf16"}), False, "split", True, "muon"),
    ("auto", "cpu", EPYC_NO_BF16, False, "split", True, "adamw"),
    ("auto", "cuda:0", frozenset(), True, "single", True, "adamw"),  # MiniMind's one AdamW group
    ("auto", "cuda:0", frozenset(), True, "split", False, "adamw"),  # a torch without Muon
    ("muon", "cpu", EPYC_NO_BF16, False, "split", True, "muon"),  # explicit flags win
    ("adamw", "cuda:0", frozenset(), True, "split", True, "adamw"),
])
def test_resolve_optimizer(flag, device, cpu_flags, cuda_bf16, groups, has_muon, expected):
    name, why = optim.resolve_optimizer(flag, device, cpu_flags, cuda_bf16, groups, has_muon)
    assert name == expected
    assert why


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n\n")
    flags = optim.read_cpu_flags(str(cpuinfo))
    assert {"amx_bf16", "avx512f"} <= flags
    assert resolve_dtype("auto", "cpu", flags)[0] == "bfloat16"
    assert optim.read_cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("capability, bf16_native, expected", [
    ((9, 0), True, True), ((8, 0), True, True), ((7, 5), False, False), ((7, 0), True, False),
])
def test_cuda_bf16_detection(monkeypatch, capability, bf16_native, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_native)
    assert optim.cuda_has_native_bf16("cuda:0") is expected
    assert optim.detect_dtype("auto", "cuda:0")[0] == ("bfloat16" if expected else "float16")


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
    assert [type(o).__name__ for o in opt] == ["AdamW", "Muon"]
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


# ---------------------------------------------------------------------------- Muon, distributed
WORKER = REPO_ROOT / "tests" / "muon_step_worker.py"


def _muon_steps(tmp_path, name, parallel, nproc):
    """The worker's losses and weights: ranks forked from the preloaded trainer
    (tests/forked_ranks.py), or for one process in this process."""
    out = tmp_path / f"{name}.pt"
    if nproc == 1:
        result = run_in_process(lambda: _run_worker_here(out, parallel), tmp_path)
    else:
        result = train_forked(nproc, [out, parallel], tmp_path, timeout=300, script=WORKER)
    assert_clean_exit(result.returncode, result.stdout, f"{nproc}-process Muon run")
    return torch.load(out, weights_only=True)


def _run_worker_here(out, parallel):
    argv, sys.argv = sys.argv, [str(WORKER), str(out), parallel]
    try:
        runpy.run_path(str(WORKER), run_name="__main__")
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def muon_single(tmp_path_factory):
    return _muon_steps(tmp_path_factory.mktemp("muon"), "single", "ddp", 1)


def _relative_update_error(run, reference, init):
    """max over tensors of |run - reference| / |reference - init| (Frobenius norms)."""
    return max(((run[k] - reference[k]).norm() / (reference[k] - init[k]).norm()).item() for k in reference)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_muon_data_parallel_matches_one_process(muon_single, tmp_path, parallel):
    """Muon orthogonalises each whole gradient matrix in bf16 (torch.optim.Muon), so a
    correct data-parallel run agrees with one process up to bf16 rounding (~2% of the
    update, measured); Newton-Schulz on each FSDP shard alone would be 30-60% off."""
    run = _muon_steps(tmp_path, parallel, parallel, 2)
    init = tiny_model().state_dict()
    assert run["losses"][0] == pytest.approx(muon_single["losses"][0], abs=1e-5)  # same start, same batch
    assert run["losses"][-1] == pytest.approx(muon_single["losses"][-1], abs=1e-3)
    assert _relative_update_error(run["weights"], muon_single["weights"], init) < 0.05


@pytest.mark.slow
def test_muon_resumes_bitwise_after_a_kill(tmp_path):
    """One process, Muon + AdamW: killed at step 5, resumed from the step-4 checkpoint,
    the final weights and optimizer state of both optimizers equal an uninterrupted run's.
    Only the killed run is a process of its own (it SIGKILLs itself: forked from the
    preloaded trainer); the uninterrupted and the resumed run are in-process, on one thread
    as the forked one."""
    base = [*TINY, "--optimizer", "muon", "--max_steps", "6", "--save_interval", "2"]  # the later flag wins
    whole = train_in_process([*base, *out_args(tmp_path / "whole")], tmp_path)
    assert whole.returncode == 0, whole.stdout[-3000:]
    killed = train_forked(1, [*base, *out_args(tmp_path / "killed")], tmp_path,
                          env={"MINIMIND_FAULT_AT_STEP": "5", "MINIMIND_FAULT_KIND": "kill"})
    assert killed.returncode != 0
    resumed = train_in_process([*base, *out_args(tmp_path / "killed"), "--from_resume", "1"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout and "step 4/6" in resumed.stdout
    a, b = latest_checkpoint(tmp_path / "whole"), latest_checkpoint(tmp_path / "killed")
    assert a["global_step"] == b["global_step"] == 6
    assert_bitwise_equal(a["model"], b["model"])
    states_a, states_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert states_a.keys() == states_b.keys()
    assert any("momentum_buffer" in s for s in states_a.values())  # Muon's state is in there
    assert any("exp_avg" in s for s in states_a.values())          # and AdamW's
    for key in states_a:
        assert_bitwise_equal(states_a[key], states_b[key])


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
    from trainer.train_pretrain import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400))
    torch.nn.init.zeros_(model.lm_head.weight)  # tied: the embedding too, so every logit is 0
    text = "héllo"
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
    x = torch.tensor([ids + [tok.pad_token_id] * 3])
    labels = torch.tensor([ids + [-100] * 3])  # padded layout: the model shifts
    loss, bpb = evaluate(model, [(x, labels)], nullcontext(), "cpu", False, token_byte_lengths(tok, 6400))
    n_targets = len(ids) - 1
    assert loss == pytest.approx(math.log(6400), rel=1e-5)
    assert bpb == pytest.approx(n_targets * math.log2(6400) / 6, rel=1e-5)


def test_eval_llm_and_trainer_validation_agree_on_bits_per_byte(tmp_path):
    """The same documents scored by scripts/eval_llm.py and by the trainer's evaluate()."""
    import json
    from contextlib import nullcontext

    from torch.utils.data import DataLoader

    from dataset.lm_dataset import PretrainDataset, load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from scripts.eval_llm import perplexity
    from trainer.train_pretrain import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    docs = tmp_path / "val.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                            ["Return the value.", "Ünïcödé text 你好", "x = 1\ny = 2\n" * 3]))
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400)).eval()
    _, _, loss, bpb = perplexity(model, tok, docs, max_seq_len=64)
    loader = DataLoader(PretrainDataset(str(docs), tok, 64), batch_size=2)
    loss_t, bpb_t = evaluate(model, loader, nullcontext(), "cpu", False, token_byte_lengths(tok, 6400))
    assert bpb_t == pytest.approx(bpb, rel=1e-5) and loss_t == pytest.approx(loss, rel=1e-5)


def test_wandb_records_the_accumulation_that_global_batch_size_implies():
    from types import SimpleNamespace

    from trainer.settings import RunSettings

    args = SimpleNamespace(accumulation_steps=1, dtype="auto", optimizer="auto", global_batch_size=16)
    flags = RunSettings("float32", "adamw", "cpu", False).as_flags(args, accumulation_steps=2)
    assert (flags["accumulation_steps"], flags["dtype"], flags["optimizer"]) == (2, "float32", "adamw")
    assert args.accumulation_steps == 1  # the parsed flags are left as they were
