"""trainer/config.py and trainer/auto.py: the typed config built from the command line, the
one rule a resume follows, and what the auto flags become: --dtype auto and --optimizer auto on
each kind of machine (the hardware facts passed in), the schedule, NorMuon and the lrs of a new
run, and how a resume keeps its checkpoint's."""
import json
import re

import pytest
import torch

from common.errors import UserError
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args
from tests.support.tiny import TINY, ensure_demo_corpus
from trainer import auto, device
from trainer.auto import (ADAMW_LR_BESIDE_MUON, ADAMW_LR_BY_WIDTH, fresh_recipe, resolve_auto, resolve_dtype,
                          resolve_optimizer)
from trainer.config import FIXED, TrainConfig, legacy_record, parse_config, resume_config
from trainer.metrics import muon_flop_share

AMX_XEON = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16_ONLY = frozenset({"avx2", "avx512f", "avx512_bf16"})
EPYC_NO_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512bw"})


# ---------------------------------------------------------------------------- the config
def test_the_config_holds_every_default_and_knows_what_was_typed():
    cfg, typed = parse_config(["--learning_rate", "1e-3", "--hidden_size", "256", "--use_wandb"])
    assert typed == {"learning_rate", "hidden_size", "use_wandb"}
    assert (cfg.optim.learning_rate, cfg.model.hidden_size, cfg.output.use_wandb) == (1e-3, 256, True)
    assert cfg.optim.batch_size == 32 and cfg.optim.muon_lr == "auto"  # defaults, as the fields give them
    assert cfg == TrainConfig.of(learning_rate=1e-3, hidden_size=256, use_wandb=True)
    with pytest.raises(Exception):
        cfg.optim.learning_rate = 1.0  # frozen: built once
    record = cfg.record()
    assert record["optim"]["learning_rate"] == 1e-3 and set(record) == {"output", "optim", "model", "data", "system",
                                                                       "chat"}


def test_fine_tunings_defaults_are_one_table_of_overrides():
    from trainer.train_full_sft import SFT, SFT_DEFAULTS

    cfg, typed = parse_config(["--seed", "3"], SFT)
    assert typed == {"seed"} and cfg.optim.seed == 3
    for name, value in SFT_DEFAULTS.items():
        assert cfg.flags()[name] == value, name
    assert parse_config([])[0].optim.lr_schedule == "auto"  # pre-training's own default is untouched
    with pytest.raises(SystemExit):
        parse_config(["--add_system_ratio", "0.5"])  # pre-training has no conversation flags


def test_the_resume_rule_stored_values_typed_flags_and_fixed_ones():
    stored = TrainConfig.of(learning_rate=1e-3, num_hidden_layers=4, lr_schedule="cosine", normuon=0, muon_lr=0.01,
                            optimizer="muon", save_interval=7, dtype="bfloat16").record()
    cfg, typed = parse_config(["--max_steps", "50", "--optimizer", "auto"])
    resumed, origin = resume_config(cfg, typed, stored)
    # the run's groups come from the checkpoint ...
    assert (resumed.optim.learning_rate, resumed.model.num_hidden_layers, resumed.optim.lr_schedule,
            resumed.optim.normuon, resumed.optim.muon_lr, resumed.optim.optimizer) == (1e-3, 4, "cosine", 0, 0.01, "muon")
    assert origin["learning_rate"] == origin["optimizer"] == "stored"  # "auto" typed is no value
    # ... but for what was typed here; the launch's groups are this command line's
    assert resumed.optim.max_steps == 50 and origin["max_steps"] == "typed"
    assert (resumed.output.save_interval, resumed.system.dtype) == (100, "auto")
    typed_lr = resume_config(*parse_config(["--learning_rate", "2e-3", "--muon_lr", "0.004"]), stored)[0]
    assert (typed_lr.optim.learning_rate, typed_lr.optim.muon_lr) == (2e-3, 0.004)  # a user's call, as before
    for flag, value in [("lr_schedule", "wsd"), ("normuon", "1"), ("optimizer", "adamw"), ("num_hidden_layers", "8")]:
        assert flag in FIXED
        with pytest.raises(UserError, match=rf"^--{flag} {value}: the checkpoint this run resumes trained with "):
            resume_config(*parse_config([f"--{flag}", value]), stored, "the checkpoint")
    same = resume_config(*parse_config(["--num_hidden_layers", "4"]), stored)[0]  # agreeing is fine
    assert same.model.num_hidden_layers == 4


def test_a_record_of_an_earlier_version_names_its_optimizer_and_schedule():
    record = {"global_step": 4, "optimizer": "muon", "lr_schedule": "cosine", "normuon": 0, "muon_lr": 0.02}
    assert legacy_record(record) == {"optim": {"optimizer": "muon", "lr_schedule": "cosine", "normuon": 0,
                                               "muon_lr": 0.02}}
    assert legacy_record({"global_step": 4}) == {}
    whole = TrainConfig().record()
    assert legacy_record({"config": whole}) is whole


def test_auto_for_a_new_run_and_for_a_resume():
    from model.model_minimind import MiniMindConfig

    model = MiniMindConfig(hidden_size=256, num_hidden_layers=2)
    cfg = resolve_auto(TrainConfig.of(dtype="float32"), {}, torch.device("cpu"), False, model, 8 * 340)
    assert (cfg.optim.optimizer, cfg.optim.lr_schedule, cfg.optim.normuon, cfg.optim.muon_lr) == ("muon", "wsd", 1, 0.01)
    assert cfg.optim.learning_rate == ADAMW_LR_BESIDE_MUON == 3e-3  # AdamW on the embedding and norms only
    adamw = resolve_auto(TrainConfig.of(dtype="float32", optimizer="adamw"), {"optimizer": "typed"},
                         torch.device("cpu"), False, model, 8 * 340)
    assert adamw.optim.normuon == 0  # NorMuon is Muon's
    assert adamw.optim.learning_rate == dict(ADAMW_LR_BY_WIDTH)[256]  # AdamW on everything: by width
    wide = MiniMindConfig(hidden_size=768, num_hidden_layers=2)  # auto takes AdamW where Newton-Schulz costs too much
    tiny_batch = resolve_auto(TrainConfig.of(dtype="float32"), {}, torch.device("cpu"), False, wide, 64)
    assert (tiny_batch.optim.optimizer, tiny_batch.optim.learning_rate) == ("adamw", dict(ADAMW_LR_BY_WIDTH)[768])
    typed = resolve_auto(TrainConfig.of(dtype="float32", optimizer="adamw", learning_rate=1e-3),
                         {"learning_rate": "typed"}, torch.device("cpu"), False, model, 8 * 340)
    assert typed.optim.learning_rate == 1e-3
    kept = resolve_auto(TrainConfig.of(dtype="float32", optimizer="adamw", lr_schedule="cosine", muon_lr=0.03),
                        {"lr_schedule": "stored"}, torch.device("cpu"), False, model, 8 * 340)
    assert (kept.optim.lr_schedule, kept.optim.muon_lr) == ("cosine", 0.03)


def test_weight_decay_and_the_document_mask_follow_the_optimizer():
    """auto: weight decay 0.3 and attention within documents with Muon, torch's 0.01 and attention
    across the window for AdamW on everything, whichever way the optimizer was chosen; a typed or
    stored value stays."""
    from model.model_minimind import MiniMindConfig

    def resolved(model, tokens, origin=None, **flags):
        cfg = resolve_auto(TrainConfig.of(dtype="float32", **flags), origin or {}, torch.device("cpu"), False, model,
                           tokens)
        return cfg.optim.optimizer, cfg.optim.weight_decay, cfg.data.doc_mask

    small = MiniMindConfig(hidden_size=256, num_hidden_layers=2)
    wide = MiniMindConfig(hidden_size=768, num_hidden_layers=2)
    assert resolved(small, 8 * 340) == ("muon", 0.3, 1)
    assert resolved(small, 8 * 340, {"optimizer": "typed"}, optimizer="adamw") == ("adamw", 0.01, 0)
    assert resolved(wide, 64) == ("adamw", 0.01, 0)  # auto took AdamW: Newton-Schulz would cost too much
    assert resolved(small, 8 * 340, {"weight_decay": "typed", "doc_mask": "stored"}, weight_decay=0.05,
                    doc_mask=0) == ("muon", 0.05, 0)


@pytest.mark.parametrize("hidden_size, muon_lr", [(64, 0.01), (256, 0.01), (384, 0.015), (512, 0.02), (640, 0.02),
                                                   (768, 0.02), (1024, 0.02)])
def test_a_new_runs_muon_lr_follows_the_width_it_was_measured_at(hidden_size, muon_lr):
    """The measured points, 0.01 at 256 and 0.02 at 512 and 768 (docs/time-to-quality.md); a
    straight line between (384: half way from 0.01 to 0.02); the nearest point's beyond them."""
    assert fresh_recipe(hidden_size, "muon")["muon_lr"] == muon_lr


@pytest.mark.parametrize("hidden_size, adamw_lr", [(64, 1.5e-3), (256, 1.5e-3), (384, 9.375e-4), (512, 3.75e-4),
                                                    (640, 2.8125e-4), (768, 1.875e-4), (1024, 1.875e-4)])
def test_a_new_runs_adamw_lr_follows_the_width_it_was_measured_at_when_it_trains_everything(hidden_size, adamw_lr):
    """AdamW on everything: 1.5e-3 at 256, 3.75e-4 at 512 and 1.875e-4 at 768 (docs/time-to-quality.md),
    a straight line between (384: 1.5e-3 + (3.75e-4 - 1.5e-3) / 2), the nearest beyond. Beside Muon,
    on the embedding and norms, 3e-3 at every width."""
    assert fresh_recipe(hidden_size, "adamw")["learning_rate"] == adamw_lr
    assert fresh_recipe(hidden_size, "muon")["learning_rate"] == 3e-3


# ---------------------------------------------------------------------------- auto on each machine
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


@pytest.mark.parametrize("device_type, dtype, cpu_flags, groups, expected", [
    ("cuda", "bfloat16", frozenset(), "split", "muon"),
    ("cuda", "float32", frozenset(), "split", "muon"),    # fp32 Newton-Schulz (TF32 on CUDA)
    ("cuda", "float16", frozenset(), "split", "adamw"),   # a T4: no bf16, fp32 Newton-Schulz is slow there
    ("cpu", "bfloat16", AMX_XEON, "split", "muon"),
    ("cpu", "bfloat16", AVX512_BF16_ONLY, "split", "muon"),
    ("cpu", "float32", EPYC_NO_BF16, "split", "muon"),      # fp32 Newton-Schulz: fast on any CPU
    ("cpu", "bfloat16", EPYC_NO_BF16, "split", "adamw"),    # --dtype bfloat16 where it is emulated
    ("cuda", "bfloat16", frozenset(), "single", "adamw"),  # MiniMind's one AdamW group
])
def test_resolve_optimizer(device_type, dtype, cpu_flags, groups, expected):
    name, why = resolve_optimizer(device_type, dtype, cpu_flags, groups)
    assert name == expected
    assert why.startswith("auto: ")


@pytest.mark.parametrize("share, expected", [(0.0, "muon"), (0.5966, "muon"), (0.6, "muon"), (0.61, "adamw"),
                                             (0.9539, "adamw"), (1.35, "adamw")])
def test_auto_takes_adamw_where_newton_schulz_would_add_more_than_the_bound(share, expected):
    for device_type, dtype, cpu_flags in [("cpu", "float32", EPYC_NO_BF16), ("cpu", "bfloat16", AMX_XEON),
                                          ("cuda", "bfloat16", frozenset())]:
        name, why = resolve_optimizer(device_type, dtype, cpu_flags, muon_share=share)
        assert name == expected, (device_type, dtype)
        assert f"{share:.0%}" in why and "60%" in why


def test_the_muon_share_is_the_ratio_of_counted_flops():
    """muon_flop_share against torch's FlopCounterMode: one Muon step's FLOPs over one forward
    and backward of the same model on the same tokens (a tiny model, 8 x 64 tokens)."""
    from torch.utils.flop_counter import FlopCounterMode

    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from trainer.optim import Muon
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
    estimated = muon_flop_share(config, tokens.numel(), 64)
    assert estimated == pytest.approx(counted, rel=0.1), (estimated, counted)
    # Measured on CPU (docs/performance.md, docs/time-to-quality.md): at 2,720 tokens a step 256 x 4,
    # 512 x 8 and 768 x 8 are Muon's (Muon arrived sooner in seconds at each), a 16-layer 1024 is not
    # (unmeasured, past the bound); the 64M model at a GPU batch of 32 x 1024 is.
    assert muon_flop_share(MiniMindConfig(hidden_size=256, num_hidden_layers=4), 2720, 340) < 0.25
    assert 0.5 < muon_flop_share(MiniMindConfig(hidden_size=512, num_hidden_layers=8), 2720, 340) < 0.75
    assert 0.9 < muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 2720, 340) < 1.0
    assert muon_flop_share(MiniMindConfig(hidden_size=1024, num_hidden_layers=16), 2720, 340) > 1.0
    assert muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 32768, 1024) < 0.1


def test_the_default_run_picks_muon_on_every_cpu():
    """Whatever the CPU, the trainer's defaults (MiniMind's 768 x 8 model, batch 32 x 340 tokens;
    one process) with --dtype auto and --optimizer auto give Muon."""
    from trainer.trainer_utils import model_config

    cfg = parse_config([])[0]
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers) == (768, 8)
    tokens = cfg.optim.batch_size * cfg.optim.accumulation_steps * cfg.model.max_seq_len
    share = muon_flop_share(model_config(cfg), tokens, cfg.model.max_seq_len)
    for cpu_flags in (AMX_XEON, AVX512_BF16_ONLY, EPYC_NO_BF16, frozenset()):
        dtype, _ = resolve_dtype("auto", "cpu", cpu_flags)
        assert resolve_optimizer("cpu", dtype, cpu_flags, muon_share=share)[0] == "muon", (cpu_flags, share)


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
    assert auto.detect_dtype("auto", torch.device("cuda", 0))[0] == ("bfloat16" if expected else "float16")


def test_wandb_records_the_resolved_config_and_the_accumulation_global_batch_size_implies(tmp_path, monkeypatch):
    """What wandb's run config holds: every flag, resolved, with --global_batch_size's accumulation."""
    import sys
    from types import SimpleNamespace

    seen = {}
    run = SimpleNamespace(id="fake", log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: seen.update(kw) or run))
    ensure_demo_corpus()
    result = run_trainer([*TINY, "--max_steps", "1", "--global_batch_size", "8", "--use_wandb", *out_args(tmp_path)],
                         tmp_path, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stdout[-3000:]
    config = seen["config"]
    assert (config["accumulation_steps"], config["optimizer"], config["dtype"], config["lr_schedule"]) == \
        (2, "muon", "float32", "wsd")


def test_the_trainer_logs_what_optimizer_auto_chose_and_why_in_one_line(tmp_path):
    """An fp32 run on any CPU: Muon, with the rule and the share behind it on one log line."""
    ensure_demo_corpus()
    result = run_trainer([*TINY, "--max_steps", "1", *out_args(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if "optimizer: muon (auto: " in line]
    assert len(lines) == 1 and re.fullmatch(
        r"optimizer: muon \(auto: Newton-Schulz in fp32, native here, adds (\d+)% to each step's FLOPs, "
        r"within the 60% it may\)", lines[0]), lines


def test_a_resume_with_fewer_tokens_per_step_keeps_muon(tmp_path):
    """--optimizer auto weighs Newton-Schulz against the tokens of a step, which a resume may change
    (another --batch_size, or another process count): the run keeps the optimizer its checkpoint
    trained with, whatever auto would weigh at the new batch (the stored choice, not a new decision,
    shows in the log), and an explicit other optimizer stops at once in one line."""
    ensure_demo_corpus()
    base = [*TINY, *out_args(tmp_path), "--save_interval", "2", "--max_steps", "8"]
    first = run_trainer([*base, "--max_steps", "2"], tmp_path / "first")
    assert first.returncode == 0 and "optimizer: muon (auto: Newton-Schulz" in first.stdout, first.stdout[-3000:]
    other = run_trainer([*base, "--batch_size", "2", "--from_resume", "1", "--optimizer", "adamw"], tmp_path / "other")
    assert other.returncode == 2 and "Traceback" not in other.stdout
    assert re.search(r"error: --optimizer adamw: checkpoint \S+_resume_step0000002.pth this run resumes trained with "
                     r"--optimizer muon", other.stdout)
    resumed = run_trainer([*base, "--batch_size", "2", "--from_resume", "1"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "optimizer: muon (the checkpoint's)" in resumed.stdout
    assert re.search(r"resumed from \S+ at step 4/8", resumed.stdout)  # 2 steps of 4 samples: 4 of 2

    # A checkpoint whose record names no config (written before it did): one line too.
    for record in (tmp_path / "ckpt").glob("*.json"):
        record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "config"}))
    older = run_trainer([*base, "--from_resume", "1", "--optimizer", "adamw"], tmp_path / "older")
    assert older.returncode == 2 and "Traceback" not in older.stdout, older.stdout[-3000:]
    assert "its optimizer state has no 'param_groups.0.momentum' for this run's optimizer" in older.stdout


@pytest.mark.parametrize("record", ["whole", "earlier_version"])
def test_a_resume_with_only_from_resume_trains_on_as_the_run_started(tmp_path, record):
    """A run started with flags other than the defaults (the cosine, plain Muon, Muon at 0.02,
    another warmup, decay and floor) resumes with `--from_resume 1` and none of them: bitwise the run it
    would have been uninterrupted. Its record holds the whole config; a record of the version
    before, which named only the optimizer, schedule, NorMuon and Muon's lr, resumes the same when
    the rest is typed again. A flag the checkpoint contradicts stops in one line."""
    ensure_demo_corpus()
    base = [*TINY, "--save_interval", "3", "--max_steps", "6"]
    recipe = ["--lr_schedule", "cosine", "--normuon", "0", "--muon_lr", "0.02"]
    others = ["--warmup_steps", "2", "--weight_decay", "0.05", "--min_lr_frac", "0.2"]
    whole = run_trainer([*base, *recipe, *others, *out_args(tmp_path / "whole")], tmp_path / "whole")
    first = run_trainer([*base, *recipe, *others, "--max_steps", "3", *out_args(tmp_path / "cut")], tmp_path / "cut")
    assert whole.returncode == 0 and first.returncode == 0, first.stdout[-3000:]
    again = [*base, *out_args(tmp_path / "cut"), "--from_resume", "1"]
    clash = run_trainer([*again, "--normuon", "1"], tmp_path / "cut")
    assert clash.returncode == 2 and "Traceback" not in clash.stdout
    assert re.search(r"error: --normuon 1: checkpoint \S+ this run resumes trained with --normuon 0", clash.stdout)
    if record == "earlier_version":  # as bbbd5ff wrote them
        for path in (tmp_path / "cut" / "ckpt").glob("*.json"):
            saved = json.loads(path.read_text())
            earlier = {k: saved[k] for k in ("global_step", "tokens_seen", "world_size", "files")}
            earlier.update({k: saved["config"]["optim"][k] for k in ("optimizer", "lr_schedule", "normuon", "muon_lr")})
            path.write_text(json.dumps(earlier))
        again += others
    resumed = run_trainer(again, tmp_path / "cut")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    for line in ("lr_schedule: cosine (the checkpoint's)", "normuon: 0 (the checkpoint's)",
                 "muon_lr: 0.02 (the checkpoint's)"):
        assert line in resumed.stdout
    whole_model, cut_model = (latest_checkpoint(tmp_path / name)["model"] for name in ("whole", "cut"))
    assert latest_checkpoint(tmp_path / "cut")["global_step"] == 6
    for key, value in whole_model.items():
        assert torch.equal(value, cut_model[key]), key


# ---------------------------------------------------------------------------- the checks see the final config
def _resume_with(tmp_path, stored: dict, typed_flags: list, stage=None):
    """settle_config (trainer/loop.py) on a resume whose newest checkpoint's record stores a run of
    `stored` flags (resolved, as a run records it), with `typed_flags` typed now. The checkpoint
    file itself is not read before the config is settled: an empty one stands in for it."""
    from types import SimpleNamespace

    from trainer.loop import settle_config

    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    flags = [*TINY, "--checkpoint_dir", str(folder), "--save_dir", str(tmp_path / "out"), "--from_resume", "1",
             "--from_weight", "none"]
    cfg, typed = parse_config([*flags, *typed_flags], stage)
    base = {"dtype": "float32", "optimizer": "muon", "normuon": 1, "muon_lr": 0.01, "lr_schedule": "wsd"}
    record = TrainConfig.of(**{**parse_config(flags, stage)[0].flags(), **base, **stored}).record()
    checkpoint = folder / "pretrain_64_resume_step0000002.pth"
    if stage is not None:
        checkpoint = folder / "full_sft_64_resume_step0000002.pth"
    checkpoint.write_bytes(b"")
    checkpoint.with_name(checkpoint.name + ".json").write_text(json.dumps(
        {"global_step": 2, "tokens_seen": 512, "world_size": 1, "config": record, "files": {}}))
    env = SimpleNamespace(device=torch.device("cpu"), world_size=1, distributed=False, rank=0, local_rank=0)
    return settle_config(cfg, typed, env)[0]


SFT_RESUMES = [  # (stored, typed, the line's start): a conversation flag and a packed file, either way round
    ({"data_path": "/data/sft.bin"}, ["--add_system_ratio", "0.2"], "--data_path /data/sft.bin: a packed file"),
    ({"data_path": "/data/sft.bin"}, ["--empty_think_ratio", "0.5"], "--data_path /data/sft.bin: a packed file"),
    ({"data_path": "/data/sft.jsonl", "add_system_ratio": 0.2}, ["--data_path", "/data/sft.bin"],
     "--data_path /data/sft.bin: a packed file"),
]
PRETRAIN_RESUMES = [  # the optimizer's rules: each side is FIXED, so the typed one meets the stored one
    ({"optimizer": "muon"}, ["--param_groups", "single"], "--param_groups single: checkpoint"),
    ({"optimizer": "adamw", "param_groups": "single", "normuon": 0}, ["--optimizer", "muon"],
     "--optimizer muon: checkpoint"),
    ({"optimizer": "adamw", "normuon": 0}, ["--normuon", "1"], "--normuon 1: checkpoint"),
    ({"optimizer": "muon", "normuon": 1}, ["--optimizer", "adamw"], "--optimizer adamw: checkpoint"),
]


@pytest.mark.parametrize("stored, typed, message", SFT_RESUMES + PRETRAIN_RESUMES)
def test_a_rule_between_flags_holds_for_a_typed_flag_against_a_stored_one(tmp_path, stored, typed, message):
    """The combination checks run on the config the resume trains with: stored values merged in.
    Before, `--add_system_ratio 0.2` typed on a resume of a packed run passed and was ignored."""
    from trainer.train_full_sft import SFT

    stage = SFT if stored.get("data_path") else None
    with pytest.raises(UserError) as info:
        _resume_with(tmp_path, stored, typed, stage)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_the_settled_config_is_resolved_and_checked_and_an_unresolved_one_is_refused(tmp_path):
    from trainer.config import check_config
    from trainer.train_full_sft import SFT

    settled = _resume_with(tmp_path, {"data_path": "/data/sft.jsonl"}, ["--add_system_ratio", "0.2"], SFT)
    assert settled.resolved and settled.chat.add_system_ratio == 0.2 and settled.data.data_path == "/data/sft.jsonl"
    assert "auto" not in settled.flags().values()
    with pytest.raises(ValueError, match="resolved config"):
        check_config(parse_config([])[0])
