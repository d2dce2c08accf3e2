"""What each `auto` flag becomes, decided once at start-up: the one owner of the auto recipes.

    --dtype        the machine's native precision (resolve_dtype)
    --optimizer    Muon where its step costs at most MUON_STEP_BOUND AdamW steps (resolve_optimizer)
    --lr_schedule, --normuon, --muon_lr    a new run's recipe at its width (fresh_recipe, MUON_LR_BY_WIDTH)

The hardware facts come in as arguments (resolve_*) or are read from this machine (detect_*,
through trainer/device.py), so the rules are tested for every machine on any one. resolve_auto
applies them to a run's config, logs each choice with its reason, and marks the config resolved.
"""
import dataclasses

import numpy
import torch

from trainer.device import cuda_has_native_bf16, native_bf16_cpu_flags, read_cpu_flags
from trainer.distributed import Logger
from trainer.metrics import muon_flop_share

AUTO_FLAGS = ("dtype", "optimizer", "lr_schedule", "normuon", "muon_lr")


# ---------------------------------------------------------------------------- the machine's choices
def resolve_dtype(flag: str, device_type: str, cpu_flags=frozenset(), cuda_bf16: bool = True,
                  sharded: bool = False) -> tuple[str, str]:
    """(dtype name, why) for --dtype `flag` on a device of `device_type` ("cpu" or "cuda").

    auto: bf16 on CUDA, fp16 (with a GradScaler) on GPUs without native bf16 -- but fp32
    under FSDP, which has no sharded GradScaler here; on CPU bf16 autocast only where the
    CPU has native bf16, since emulated bf16 is slower than fp32.
    """
    if flag != "auto":
        return flag, "--dtype"
    if device_type == "cuda":
        if cuda_bf16:
            return "bfloat16", "auto: the GPU has native bf16"
        if sharded:
            return "float32", "auto: the GPU lacks native bf16 and FSDP has no fp16 GradScaler here"
        return "float16", "auto: the GPU lacks native bf16 (fp16 with a GradScaler)"
    native = native_bf16_cpu_flags(cpu_flags)
    if native:
        return "bfloat16", f"auto: the CPU has {'/'.join(native)}"
    return "float32", "auto: the CPU lacks amx_bf16/avx512_bf16, where bf16 autocast is slower than fp32"


# --optimizer auto's criterion: the most a Muon step may cost, in AdamW steps, counted in FLOPs (1 +
# muon_flop_share). Measured (docs/performance.md): Muon reached MiniMind's final loss in 1/2.9 of AdamW's
# steps at 3e-3 at 256 x 4, 1/2.2 to 1/2.7 at 512 x 8 and 1/2.7 at 768 x 8, so a step costing up to 2.2 AdamW
# steps still arrives sooner; the bound keeps a margin below the smallest saving. At 768 x 8 with 8 x 340
# tokens a step (a 95% share) Muon arrived 1.6x sooner in seconds; against AdamW at its best lr measured
# there (7.5e-4, 1/1.73 of its steps) about 1.1x sooner, and 9.5% lower in bits per byte at the end.
MUON_STEP_BOUND = 2.0


def resolve_optimizer(device_type: str, dtype: str, cpu_flags=frozenset(), param_groups: str = "split",
                      muon_share: float = 0.0) -> tuple[str, str]:
    """(optimizer name, why) for --optimizer auto, once the run's dtype is known.

    Muon where a Muon step costs at most MUON_STEP_BOUND AdamW steps. That takes two things.
    Newton-Schulz must run in a precision the hardware does natively: fp32 on every CPU, bf16
    on CPUs and GPUs with native bf16 (not fp16 runs, whose Newton-Schulz would be fp32, nor
    emulated bf16). And its work, `muon_share` of the step's forward and backward FLOPs
    (trainer/metrics.py's muon_flop_share), must stay within the bound: at most 1.0 (double the step's FLOPs).
    """
    if param_groups == "single":
        return "adamw", "auto: --param_groups single is AdamW on everything"
    if dtype == "float16":
        return "adamw", ("auto: fp16 on a GPU without native bf16, where Muon's Newton-Schulz would run in fp32, "
                         "far below the fp16 rate of the rest of the step")
    if dtype == "bfloat16" and device_type == "cpu" and not native_bf16_cpu_flags(cpu_flags):
        return "adamw", ("auto: bf16 is emulated on this CPU, where Muon's bf16 Newton-Schulz made a step "
                         "about 6x an AdamW step")
    allowed = MUON_STEP_BOUND - 1
    if muon_share > allowed:
        return "adamw", (f"auto: Muon's Newton-Schulz would add {muon_share:.0%} to each step's FLOPs, over the "
                         f"{allowed:.0%} it may; more tokens per step (--batch_size, --accumulation_steps) lower "
                         f"it, --optimizer muon takes it anyway")
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    return "muon", (f"auto: Newton-Schulz in {precision}, native here, adds {muon_share:.0%} to each step's "
                    f"FLOPs, within the {allowed:.0%} it may")


def detect_dtype(flag: str, device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """resolve_dtype with this machine's facts."""
    on_cuda = device.type == "cuda"
    return resolve_dtype(flag, device.type, cpu_flags=frozenset() if on_cuda else read_cpu_flags(),
                         cuda_bf16=cuda_has_native_bf16(device) if on_cuda else False, sharded=sharded)


def detect_optimizer(device: torch.device, dtype: str, param_groups: str = "split",
                     muon_share: float = 0.0) -> tuple[str, str]:
    """resolve_optimizer with this machine's facts."""
    cpu_flags = read_cpu_flags() if device.type == "cpu" else frozenset()
    return resolve_optimizer(device.type, dtype, cpu_flags, param_groups, muon_share)


# ---------------------------------------------------------------------------- a new run's recipe
# Muon's peak lr at the widths it was measured at (docs/time-to-quality.md; bench_quality.py, seq
# 340, batch 8, 300 steps): at 256 x 4 0.01 beat 0.02 over 3 seeds and 0.04 lost; at 512 x 8 0.02
# beat 0.01 over 2 seeds; at 768 x 8 0.02 beat 0.04 and 0.01, 2 seeds each for the best two.
MUON_LR_BY_WIDTH = ((256, 0.01), (512, 0.02), (768, 0.02))


def muon_lr_by_width(hidden_size: int) -> float:
    """MUON_LR_BY_WIDTH's lr at a measured width, a straight line between two measured widths, and
    the nearest measured width's beyond them (no guess past what was measured)."""
    widths, lrs = zip(*MUON_LR_BY_WIDTH)
    return round(float(numpy.interp(hidden_size, widths, lrs)), 6)


def fresh_recipe(hidden_size: int) -> dict:
    """A new run's schedule, NorMuon and Muon lr under auto: what beat the older defaults over 3
    seeds (docs/time-to-quality.md), with Muon's lr by width (muon_lr_by_width)."""
    return {"lr_schedule": "wsd", "normuon": 1, "muon_lr": muon_lr_by_width(hidden_size)}


def resolve_auto(cfg, origin: dict, device, sharded: bool, lm_config, tokens_per_step: int):
    """The TrainConfig with every auto flag decided, each logged once with its reason, and marked
    resolved. origin: where each flag's value came from (trainer/config.py's resume_config; a flag
    missing there is a default)."""
    why = {"typed": "--{}", "stored": "the checkpoint's", "default": "this stage's default"}
    reasons = {name: why[origin.get(name, "default")].format(name) for name in AUTO_FLAGS}
    values = {}
    values["dtype"], reasons["dtype"] = detect_dtype(cfg.system.dtype, device, sharded)
    optimizer = cfg.optim.optimizer
    if optimizer == "auto":
        share = muon_flop_share(lm_config, tokens_per_step, cfg.model.max_seq_len)
        optimizer, reasons["optimizer"] = detect_optimizer(device, values["dtype"], cfg.optim.param_groups, share)
    values["optimizer"] = optimizer
    fresh = fresh_recipe(lm_config.hidden_size)
    for name in ("lr_schedule", "normuon", "muon_lr"):
        values[name] = getattr(cfg.optim, name)
        if values[name] == "auto":
            values[name] = fresh[name]
            reasons[name] = f"auto: a new run's default at hidden {lm_config.hidden_size} (docs/time-to-quality.md)"
    # NorMuon is Muon's: an auto choice gives way to the other flag's value. Both typed, the
    # combination stops the run in check_config, which names them.
    chosen_by_auto = "auto" in (cfg.optim.optimizer, cfg.optim.normuon)
    if optimizer != "muon" and values["normuon"] and chosen_by_auto:
        values["normuon"], reasons["normuon"] = 0, f"--optimizer {optimizer}: NorMuon is Muon's"
    for name in AUTO_FLAGS:
        Logger(f"{name}: {values[name]} ({reasons[name]})")
    return dataclasses.replace(cfg.replace(**values), resolved=True)
