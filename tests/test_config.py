"""trainer/config.py: the typed config built from the command line, the one rule a resume
follows, how a resume keeps the auto flags its checkpoint resolved, and the checks on the final
config (what each auto flag becomes: tests/test_auto.py)."""
import json
import re

import pytest
import torch

from common.errors import UserError
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args
from tests.support.tiny import TINY, ensure_demo_corpus
from trainer.config import FIXED, TrainConfig, parse_config
from trainer.resume_config import legacy_record, resume_config


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
                                               "muon_lr": 0.02, "muon_ns_steps": 5, "adam_betas": (0.9, 0.95)}}
    assert legacy_record({"global_step": 4}) == {}
    whole = TrainConfig().record()
    assert legacy_record({"config": whole}) is whole
    # A whole config stored before --muon_ns_steps existed: its run took torch.optim.Muon's 5 steps.
    before = {**whole, "optim": {k: v for k, v in whole["optim"].items() if k != "muon_ns_steps"}}
    assert legacy_record({"config": before})["optim"] == {**whole["optim"], "muon_ns_steps": 5}


# ---------------------------------------------------------------------------- the resolved config in a run
def test_wandb_records_the_resolved_config_and_the_accumulation_global_batch_size_implies(tmp_path, monkeypatch):
    """What wandb's run config holds: every flag, resolved, with --global_batch_size's accumulation."""
    import sys
    from types import SimpleNamespace

    seen = {}
    run = SimpleNamespace(id="fake", log=lambda *a, **k: None, define_metric=lambda *a, **k: None,
                          finish=lambda: None)  # a wandb Run's fields
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
    AdamW's betas 0.9,0.95, another warmup, decay and floor) resumes with `--from_resume 1` and none
    of them: bitwise the run it would have been uninterrupted. Its record holds the whole config; a
    record of the version before, which named only the optimizer, schedule, NorMuon and Muon's lr,
    resumes the same when the rest is typed again, with the betas every run of that version had.
    A flag the checkpoint contradicts stops in one line."""
    ensure_demo_corpus()
    base = [*TINY, "--save_interval", "3", "--max_steps", "6"]
    # Betas 0.9,0.95, as every run before --adam_betas auto trained: an earlier version's record lacks them.
    recipe = ["--lr_schedule", "cosine", "--normuon", "0", "--muon_lr", "0.02", "--adam_betas", "0.9,0.95"]
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
    """settle_config (trainer/resume_config.py) on a resume whose newest checkpoint's record stores a run of
    `stored` flags (resolved, as a run records it), with `typed_flags` typed now. The checkpoint
    file itself is not read before the config is settled: an empty one stands in for it."""
    from types import SimpleNamespace

    from trainer.resume_config import settle_config

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


def test_a_typed_accumulation_beside_a_global_batch_is_said_to_be_left_aside(tmp_path):
    """--global_batch_size decides the accumulation at each world size (an elastic restart reruns the
    same command on another), so a typed --accumulation_steps is not an error, but the log says so."""
    ensure_demo_corpus()
    result = run_trainer([*TINY, "--max_steps", "1", "--global_batch_size", "8", "--accumulation_steps", "4",
                          *out_args(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert ("warning: --accumulation_steps 4 is left aside: --global_batch_size 8 decides the micro-batches per step "
            "at each world size") in result.stdout
    assert "micro_batch=4 accumulation=2 global_batch=8" in result.stdout
