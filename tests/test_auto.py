"""trainer/auto.py: what the auto flags become. --dtype auto and --optimizer auto on each kind of
machine (the hardware facts passed in), a new run's schedule, NorMuon, lrs, weight decay and
document mask for its optimizer, and a typed or stored value kept."""
import json

import pytest
import torch

from trainer import auto, device
from trainer.auto import (ADAMW_LR_BESIDE_MUON, ADAMW_LR_BY_WIDTH, fresh_recipe, resolve_auto, resolve_dtype,
                          resolve_ns_steps, resolve_optimizer)
from trainer.config import TrainConfig, parse_config
from trainer.metrics import muon_flop_share
from tests.support import REPO_ROOT
from tests.support.assertions import assert_clean_exit
from tests.support.jobs import run_trainer

AMX_XEON = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16_ONLY = frozenset({"avx2", "avx512f", "avx512_bf16"})
EPYC_NO_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512bw"})


# ---------------------------------------------------------------------------- a new run's recipe
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


def test_a_normuon_asked_for_makes_auto_take_muon():
    """--normuon 1 with --optimizer auto: Muon, where auto alone would take AdamW (hidden 768 at 64
    tokens a step: Newton-Schulz's share is over the bound); beside --param_groups single, one line."""
    from common.errors import UserError
    from model.model_minimind import MiniMindConfig

    wide = MiniMindConfig(hidden_size=768, num_hidden_layers=2)
    cfg = resolve_auto(TrainConfig.of(dtype="float32", normuon=1), {"normuon": "typed"}, torch.device("cpu"), False,
                       wide, 64)
    assert (cfg.optim.optimizer, cfg.optim.normuon) == ("muon", 1)
    with pytest.raises(UserError, match="--normuon 1 changes Muon's update, and --param_groups single"):
        resolve_auto(TrainConfig.of(dtype="float32", normuon=1, param_groups="single"), {"normuon": "typed"},
                     torch.device("cpu"), False, wide, 64)


def test_weight_decay_betas_and_the_document_mask_follow_the_optimizer():
    """auto: weight decay 0.5, AdamW's beta2 0.999 and attention within documents with Muon, torch's
    0.01, beta2 0.95 and attention across the window for AdamW on everything, whichever way the
    optimizer was chosen; a typed or stored value stays."""
    from model.model_minimind import MiniMindConfig

    def resolved(model, tokens, origin=None, **flags):
        cfg = resolve_auto(TrainConfig.of(dtype="float32", **flags), origin or {}, torch.device("cpu"), False, model,
                           tokens)
        return cfg.optim.optimizer, cfg.optim.weight_decay, cfg.optim.adam_betas, cfg.data.doc_mask

    small = MiniMindConfig(hidden_size=256, num_hidden_layers=2)
    wide = MiniMindConfig(hidden_size=768, num_hidden_layers=2)
    assert resolved(small, 8 * 340) == ("muon", 0.5, (0.9, 0.999), 1)
    assert resolved(small, 8 * 340, {"optimizer": "typed"}, optimizer="adamw") == ("adamw", 0.01, (0.9, 0.95), 0)
    assert resolved(wide, 64) == ("adamw", 0.01, (0.9, 0.95), 0)  # auto took AdamW: Newton-Schulz would cost too much
    assert resolved(small, 8 * 340, {"weight_decay": "typed", "adam_betas": "typed", "doc_mask": "stored"},
                    weight_decay=0.05, adam_betas=(0.8, 0.95), doc_mask=0) == ("muon", 0.05, (0.8, 0.95), 0)


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


def test_a_typed_bf16_on_a_gpu_that_emulates_it_takes_adamw():
    assert resolve_optimizer("cuda", "bfloat16", cuda_bf16=False)[0] == "adamw"  # a V100 with --dtype bfloat16
    assert resolve_optimizer("cuda", "float32", cuda_bf16=False)[0] == "muon"


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
    # Measured on CPU (docs/performance.md, docs/time-to-quality.md): at 2,720 tokens a step 256 x 4
    # (22%) and 512 x 8 (60%) are Muon's with 5 steps, where it arrived sooner in seconds; 768 x 8 (95%)
    # was AdamW's at 5 steps and is Muon's at 3 (57%); a 16-layer 1024 is past the bound even at 3; the
    # 64M model at a GPU batch of 32 x 1024 is Muon's.
    assert muon_flop_share(MiniMindConfig(hidden_size=256, num_hidden_layers=4), 2720, 340) < 0.25
    assert 0.5 < muon_flop_share(MiniMindConfig(hidden_size=512, num_hidden_layers=8), 2720, 340) < 0.75
    assert 0.9 < muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 2720, 340) < 1.0
    assert 0.5 < muon_flop_share(MiniMindConfig(hidden_size=768, num_hidden_layers=8), 2720, 340, 3) < 0.6
    assert muon_flop_share(MiniMindConfig(hidden_size=1024, num_hidden_layers=16), 2720, 340, 3) > 0.6
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


def test_muon_takes_three_newton_schulz_steps_where_five_would_cost_more_than_the_bound(capsys):
    """auto: torch.optim.Muon's 5 steps where they add at most 60% to a step's FLOPs, else 3; and
    --optimizer auto weighs the steps it will run. A typed or stored value stays."""
    from model.model_minimind import MiniMindConfig

    assert resolve_ns_steps("auto", lambda steps: 0.12 * steps)[0] == 5   # 60%: within the bound
    steps, why = resolve_ns_steps("auto", lambda steps: 0.19 * steps)    # 95% at 5, 57% at 3
    assert steps == 3 and "95%" in why and "57%" in why
    assert resolve_ns_steps(4, lambda steps: 1.0) == (4, None)  # given: the log says by whom
    capsys.readouterr()
    stored = resolve_auto(TrainConfig.of(dtype="float32", muon_ns_steps=5), {"muon_ns_steps": "stored"},
                          torch.device("cpu"), False, MiniMindConfig(hidden_size=256, num_hidden_layers=2), 8 * 340)
    assert stored.optim.muon_ns_steps == 5 and "muon_ns_steps: 5 (the checkpoint's)" in capsys.readouterr().out

    def resolved(model, tokens, origin=None, **flags):
        cfg = resolve_auto(TrainConfig.of(dtype="float32", **flags), origin or {}, torch.device("cpu"), False, model,
                           tokens)
        return cfg.optim.optimizer, cfg.optim.muon_ns_steps

    small, default = MiniMindConfig(hidden_size=256, num_hidden_layers=4), MiniMindConfig()
    assert resolved(small, 8 * 340) == ("muon", 5)             # 22%
    assert resolved(default, 32 * 340) == ("muon", 5)          # 768 x 8 at the default batch: 24%
    assert resolved(default, 8 * 340) == ("muon", 3)           # 95% at 5 steps, 57% at 3
    assert resolved(default, 8 * 340, {"muon_ns_steps": "typed"}, muon_ns_steps=5) == ("adamw", 5)
    assert resolved(default, 64) == ("adamw", 3)              # over the bound even at 3 steps
    assert resolved(default, 8 * 340, {"muon_ns_steps": "stored"}, muon_ns_steps=5,
                    optimizer="muon") == ("muon", 5)


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


def test_ranks_on_unlike_hardware_all_take_rank_0_s_decisions(tmp_path):
    """Rank 1 reads a CPU without bf16, so alone it would train in fp32 while rank 0 trains in
    bf16 (and on GPUs of unlike kinds, one side with Muon and the other with AdamW, each then
    waiting in collectives the other never joins): every rank takes rank 0's reading."""
    prefix = tmp_path / "auto"
    result = run_trainer([prefix], tmp_path, nproc=2, mode="forked", timeout=120,
                         script=REPO_ROOT / "tests" / "support" / "auto_worker.py")
    assert_clean_exit(result.returncode, result.stdout, "2-process resolve_auto")
    decided = [json.loads(prefix.with_name(f"auto_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert decided[0] == decided[1] == {"dtype": "bfloat16", "optimizer": "muon"}, decided
