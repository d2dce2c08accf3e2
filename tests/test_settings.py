"""trainer/settings.py and trainer/device.py: what --dtype auto and --optimizer auto become
on each kind of machine (the hardware facts passed in), and how this machine's are read."""
import re

import pytest
import torch

from trainer import device, settings
from common.errors import UserError
from trainer.settings import resolve_dtype, resolve_optimizer

AMX_XEON = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16_ONLY = frozenset({"avx2", "avx512f", "avx512_bf16"})
EPYC_NO_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512bw"})


@pytest.mark.parametrize("flag, device_type, cpu_flags, cuda_bf16, sharded, expected", [
    ("auto", "cpu", AMX_XEON, False, False, "bfloat16"),
    ("auto", "cpu", AVX512_BF16_ONLY, False, False, "bfloat16"),
    ("auto", "cpu", EPYC_NO_BF16, False, False, "float32"),
    ("auto", "cpu", frozenset(), False, False, "float32"),
    ("auto", "cuda", frozenset(), True, False, "bfloat16"),
    ("auto", "cuda", frozenset(), False, False, "float16"),
    ("auto", "cuda", frozenset(), False, True, "float32"),  # FSDP: no sharded GradScaler
    ("float32", "cuda", frozenset(), True, False, "float32"),
    ("bfloat16", "cpu", EPYC_NO_BF16, False, False, "bfloat16"),
])
def test_resolve_dtype(flag, device_type, cpu_flags, cuda_bf16, sharded, expected):
    name, why = resolve_dtype(flag, device_type, cpu_flags, cuda_bf16, sharded)
    assert name == expected
    assert why


@pytest.mark.parametrize("flag, device_type, dtype, cpu_flags, groups, expected", [
    ("auto", "cuda", "bfloat16", frozenset(), "split", "muon"),
    ("auto", "cuda", "float32", frozenset(), "split", "muon"),    # fp32 Newton-Schulz (TF32 on CUDA)
    ("auto", "cuda", "float16", frozenset(), "split", "adamw"),   # a T4: no bf16, fp32 Newton-Schulz is slow there
    ("auto", "cpu", "bfloat16", AMX_XEON, "split", "muon"),
    ("auto", "cpu", "bfloat16", AVX512_BF16_ONLY, "split", "muon"),
    ("auto", "cpu", "float32", EPYC_NO_BF16, "split", "muon"),      # fp32 Newton-Schulz: fast on any CPU
    ("auto", "cpu", "bfloat16", EPYC_NO_BF16, "split", "adamw"),    # --dtype bfloat16 where it is emulated
    ("auto", "cuda", "bfloat16", frozenset(), "single", "adamw"),  # MiniMind's one AdamW group
    ("muon", "cpu", "bfloat16", EPYC_NO_BF16, "split", "muon"),     # explicit flags win
    ("adamw", "cuda", "bfloat16", frozenset(), "split", "adamw"),
])
def test_resolve_optimizer(flag, device_type, dtype, cpu_flags, groups, expected):
    name, why = resolve_optimizer(flag, device_type, dtype, cpu_flags, groups)
    assert name == expected
    assert why


@pytest.mark.parametrize("share, expected", [(0.0, "muon"), (0.75, "muon"), (0.76, "adamw"), (1.0, "adamw")])
def test_auto_takes_adamw_where_newton_schulz_would_add_more_than_the_bound(share, expected):
    for device_type, dtype, cpu_flags in [("cpu", "float32", EPYC_NO_BF16), ("cpu", "bfloat16", AMX_XEON),
                                          ("cuda", "bfloat16", frozenset())]:
        name, why = resolve_optimizer("auto", device_type, dtype, cpu_flags, muon_share=share)
        assert name == expected, (device_type, dtype)
        assert f"{share:.0%}" in why and "75%" in why
    assert resolve_optimizer("muon", "cpu", "float32", EPYC_NO_BF16, muon_share=1.0)[0] == "muon"  # the flag wins


def test_the_muon_share_is_the_ratio_of_counted_flops():
    """muon_flop_share against torch's FlopCounterMode: one Muon step's FLOPs over one forward
    and backward of the same model on the same tokens (a tiny model, 8 x 64 tokens)."""
    from torch.utils.flop_counter import FlopCounterMode

    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from trainer.muon import Muon
    from trainer.optim import is_block_matrix

    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    model = MiniMindForCausalLM(config)
    tokens = torch.randint(3, 6400, (8, 64))
    with FlopCounterMode(display=False) as step:
        model(tokens, labels=tokens).loss.backward()
    matrices = [p for n, p in model.named_parameters() if is_block_matrix(n, p)]
    with FlopCounterMode(display=False) as muon:
        Muon(matrices).step()
    counted = muon.get_total_flops() / step.get_total_flops()
    estimated = settings.muon_flop_share(config, tokens.numel(), 64)
    assert estimated == pytest.approx(counted, rel=0.1), (estimated, counted)
    # Measured on CPU (docs/performance.md, docs/time-to-quality.md): at 2,720 tokens a step 256 x 4 and
    # 512 x 8 are Muon's, 768 x 8 is not; the 64M model at a GPU batch of 32 x 1024 is.
    assert settings.muon_flop_share(MiniMindConfig(hidden_size=256, num_hidden_layers=4), 2720, 340) < 0.25
    assert 0.5 < settings.muon_flop_share(MiniMindConfig(hidden_size=512, num_hidden_layers=8), 2720, 340) < 0.75
    assert settings.muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 2720, 340) > 0.75
    assert settings.muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 32768, 1024) < 0.1


def test_the_default_run_picks_muon_on_every_cpu():
    """Whatever the CPU, the trainer's defaults (model, batch, length; one process) with --dtype
    auto and --optimizer auto give Muon."""
    from trainer.args import parse_args
    from trainer.trainer_utils import model_config_from_args

    args = parse_args([])
    tokens = args.batch_size * args.accumulation_steps * args.max_seq_len
    share = settings.muon_flop_share(model_config_from_args(args, args.vocab_size), tokens, args.max_seq_len)
    for cpu_flags in (AMX_XEON, AVX512_BF16_ONLY, EPYC_NO_BF16, frozenset()):
        dtype, _ = resolve_dtype("auto", "cpu", cpu_flags)
        assert resolve_optimizer("auto", "cpu", dtype, cpu_flags, muon_share=share)[0] == "muon", (cpu_flags, share)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n\n")
    flags = device.read_cpu_flags(str(cpuinfo))
    assert {"amx_bf16", "avx512f"} <= flags
    assert resolve_dtype("auto", "cpu", flags)[0] == "bfloat16"
    assert device.read_cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("capability, bf16_native, expected", [
    ((9, 0), True, True), ((8, 0), True, True), ((7, 5), False, False), ((7, 0), True, False),
])
def test_cuda_bf16_detection(monkeypatch, capability, bf16_native, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_native)
    assert device.cuda_has_native_bf16(torch.device("cuda", 0)) is expected
    assert settings.detect_dtype("auto", torch.device("cuda", 0))[0] == ("bfloat16" if expected else "float16")


def test_wandb_records_the_accumulation_that_global_batch_size_implies():
    from types import SimpleNamespace

    args = SimpleNamespace(accumulation_steps=1, dtype="auto", optimizer="auto", global_batch_size=16)
    flags = settings.RunSettings("float32", "adamw", False).as_flags(args, accumulation_steps=2)
    assert (flags["accumulation_steps"], flags["dtype"], flags["optimizer"]) == (2, "float32", "adamw")
    assert args.accumulation_steps == 1  # the parsed flags are left as they were


def test_the_trainer_logs_what_optimizer_auto_chose_and_why_in_one_line(tmp_path):
    """An fp32 run on any CPU: Muon, with the rule and the share behind it on one log line."""
    from tests.jobs import run_trainer
    from tests.run_outputs import out_args
    from tests.tiny import TINY, ensure_demo_corpus

    ensure_demo_corpus()
    result = run_trainer([*TINY, "--max_steps", "1", *out_args(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if "optimizer: muon (auto: " in line]
    assert len(lines) == 1 and re.fullmatch(
        r"optimizer: muon \(auto: Newton-Schulz in fp32, native here, adds (\d+)% to each step's FLOPs, "
        r"within the 75% it may\)", lines[0]), lines


def test_resolve_optimizer_keeps_what_the_resumed_checkpoint_trained_with():
    assert resolve_optimizer("auto", "cpu", "float32", EPYC_NO_BF16, muon_share=0.9, resumed="muon")[0] == "muon"
    assert resolve_optimizer("auto", "cpu", "float32", EPYC_NO_BF16, muon_share=0.0, resumed="adamw")[0] == "adamw"
    assert resolve_optimizer("muon", "cpu", "float32", EPYC_NO_BF16, resumed="muon")[0] == "muon"
    with pytest.raises(UserError, match=r"^--optimizer adamw: the checkpoint this run resumes trained with muon"):
        resolve_optimizer("adamw", "cpu", "float32", EPYC_NO_BF16, resumed="muon")


def test_a_resume_with_fewer_tokens_per_step_keeps_muon(tmp_path):
    """--optimizer auto weighs Newton-Schulz against the tokens of a step, which a resume may change
    (another --batch_size, or another process count): the run keeps the optimizer its checkpoint
    trained with (here 2 samples a step would have made auto pick AdamW, whose state Muon's is not),
    and an explicit other optimizer stops at once in one line."""
    from tests.jobs import run_trainer
    from tests.run_outputs import out_args
    from tests.tiny import TINY, ensure_demo_corpus

    ensure_demo_corpus()
    base = [*TINY, *out_args(tmp_path), "--save_interval", "2", "--max_steps", "8"]
    first = run_trainer([*base, "--max_steps", "2"], tmp_path / "first")
    assert first.returncode == 0 and "optimizer: muon (auto: Newton-Schulz" in first.stdout, first.stdout[-3000:]
    other = run_trainer([*base, "--batch_size", "2", "--from_resume", "1", "--optimizer", "adamw"], tmp_path / "other")
    assert other.returncode == 2 and "Traceback" not in other.stdout
    assert "error: --optimizer adamw: the checkpoint this run resumes trained with muon" in other.stdout
    resumed = run_trainer([*base, "--batch_size", "2", "--from_resume", "1"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "optimizer: muon (auto: the optimizer of the checkpoint it resumes)" in resumed.stdout
    assert re.search(r"resumed from \S+ at step 4/8", resumed.stdout)  # 2 steps of 4 samples: 4 of 2

    # A checkpoint whose record does not name its optimizer (written before it did): one line too.
    import json

    for record in (tmp_path / "ckpt").glob("*.json"):
        record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "optimizer"}))
    older = run_trainer([*base, "--from_resume", "1", "--optimizer", "adamw"], tmp_path / "older")
    assert older.returncode == 2 and "Traceback" not in older.stdout, older.stdout[-3000:]
    assert "its optimizer state has no 'param_groups.0.momentum' for this run's optimizer" in older.stdout


@pytest.mark.parametrize("name, flag, optimizer, resumed, expected", [
    ("lr_schedule", "auto", "muon", None, "wsd"),  # a new run: what the seed study chose
    ("normuon", "auto", "muon", None, 1),
    ("normuon", "auto", "adamw", None, 0),  # NorMuon is Muon's
    ("lr_schedule", "auto", "adamw", None, "wsd"),
    ("lr_schedule", "cosine", "muon", None, "cosine"),
    ("lr_schedule", "auto", "muon", {"lr_schedule": "cosine"}, "cosine"),  # a resume trains on as it started
    ("normuon", "auto", "muon", {"normuon": 0}, 0),
    ("lr_schedule", "auto", "muon", {"optimizer": "muon"}, "cosine"),  # a record from before: the default then
    ("normuon", "auto", "muon", {"optimizer": "muon"}, 0),
    ("lr_schedule", "wsd", "muon", {"optimizer": "muon"}, "wsd"),  # the user knows better than an old record
    ("muon_lr", "auto", "muon", None, 0.01),
    ("muon_lr", 0.03, "muon", None, 0.03),
    ("muon_lr", "auto", "muon", {"muon_lr": 0.005}, 0.005),
    ("muon_lr", "auto", "muon", {"optimizer": "muon"}, 0.02),
    ("muon_lr", 0.004, "muon", {"muon_lr": 0.01}, 0.004),  # a lower lr on a resume: the user's call
])
def test_resolve_recipe(name, flag, optimizer, resumed, expected):
    assert settings.resolve_recipe(name, flag, optimizer, resumed, hidden_size=256)[0] == expected


@pytest.mark.parametrize("hidden_size, muon_lr", [(64, 0.01), (256, 0.01), (384, 0.015), (512, 0.02), (768, 0.02)])
def test_a_new_runs_muon_lr_follows_the_width_it_was_measured_at(hidden_size, muon_lr):
    """0.01 at 256 and 0.02 at 512 (docs/time-to-quality.md), a straight line between, held beyond."""
    assert settings.resolve_recipe("muon_lr", "auto", "muon", None, hidden_size=hidden_size)[0] == muon_lr


def test_resolve_recipe_stops_where_the_checkpoint_says_otherwise():
    with pytest.raises(UserError, match=r"^--normuon 1: the checkpoint this run resumes trained with --normuon 0; "):
        settings.resolve_recipe("normuon", 1, "muon", {"normuon": 0}, hidden_size=256)
    with pytest.raises(UserError, match=r"^--lr_schedule cosine: the checkpoint this run resumes trained with "
                                        r"--lr_schedule wsd"):
        settings.resolve_recipe("lr_schedule", "cosine", "muon", {"lr_schedule": "wsd"}, hidden_size=256)


def test_a_run_started_on_other_defaults_resumes_as_it_started(tmp_path):
    """A run started with the cosine, plain Muon and Muon's lr at 0.02 (the defaults before wsd,
    NorMuon and the lr by width, or chosen) resumes under the new defaults (auto) on its own
    schedule, optimizer and lr: bitwise the run it would have been uninterrupted. A flag that
    contradicts the checkpoint stops in one line, and a record that predates naming them is taken
    at the old defaults, said in the log."""
    import json

    from tests.jobs import run_trainer
    from tests.run_outputs import latest_checkpoint, out_args
    from tests.tiny import TINY, ensure_demo_corpus

    ensure_demo_corpus()
    base = [*TINY, "--save_interval", "3", "--max_steps", "6", "--dtype", "float32"]
    old = ["--lr_schedule", "cosine", "--normuon", "0", "--muon_lr", "0.02"]
    whole = run_trainer([*base, *old, *out_args(tmp_path / "whole")], tmp_path / "whole")
    first = run_trainer([*base, *old, "--max_steps", "3", *out_args(tmp_path / "cut")], tmp_path / "cut")
    assert whole.returncode == 0 and first.returncode == 0, first.stdout[-3000:]
    again = [*base, *out_args(tmp_path / "cut"), "--from_resume", "1"]
    clash = run_trainer([*again, "--normuon", "1"], tmp_path / "cut")
    assert clash.returncode == 2 and "Traceback" not in clash.stdout
    assert "error: --normuon 1: the checkpoint this run resumes trained with --normuon 0" in clash.stdout
    for record in (tmp_path / "cut" / "ckpt").glob("*.json"):  # as written before the record named them
        kept = {k: v for k, v in json.loads(record.read_text()).items()
                if k not in ("lr_schedule", "normuon", "muon_lr")}
        record.write_text(json.dumps(kept))
    resumed = run_trainer(again, tmp_path / "cut")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "lr_schedule: cosine (auto: the checkpoint it resumes predates recording it" in resumed.stdout
    assert "normuon: 0 (auto: the checkpoint it resumes predates recording it" in resumed.stdout
    assert "muon_lr: 0.02 (auto: the checkpoint it resumes predates recording it" in resumed.stdout
    whole_model, cut_model = (latest_checkpoint(tmp_path / name)["model"] for name in ("whole", "cut"))
    assert latest_checkpoint(tmp_path / "cut")["global_step"] == 6
    for key, value in whole_model.items():
        assert torch.equal(value, cut_model[key]), key
