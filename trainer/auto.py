"""What each `auto` flag becomes, decided once at start-up: the one owner of the auto recipes.

    --dtype        the machine's native precision (resolve_dtype)
    --optimizer    Muon where its step costs at most MUON_STEP_BOUND AdamW steps (resolve_optimizer)
    --muon_ns_steps  torch.optim.Muon's 5 Newton-Schulz steps, or 3 where 5 cost too much (resolve_ns_steps)
    --lr_schedule, --normuon, --muon_lr, --learning_rate, --weight_decay, --adam_betas, --doc_mask
                   a new run's recipe at its width, for its optimizer (fresh_recipe, LR tables)

The hardware facts come in as arguments (resolve_*) or are read from this machine (detect_*,
through trainer/device.py), so the rules are tested for every machine on any one. resolve_auto
applies them to a run's config, logs each choice with its reason, and marks the config resolved.
"""
import dataclasses

import numpy
import torch

from common.errors import UserError
from trainer.device import cuda_has_native_bf16, native_bf16_cpu_flags, read_cpu_flags
from trainer.distributed import Logger, broadcast_from_main
from trainer.metrics import muon_flop_share
from trainer.optim import NS_STEPS

AUTO_FLAGS = ("dtype", "optimizer", "muon_ns_steps", "lr_schedule", "normuon", "muon_lr", "learning_rate",
              "weight_decay", "adam_betas", "doc_mask")


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
# muon_flop_share). Measured against AdamW on everything at its best lr (docs/performance.md, the EPYC,
# bf16, 8 x 340 tokens a step), Muon reached MiniMind's final loss in 1/2.2 of AdamW's steps at 256 x 4
# (a 22% share, steps of equal cost: about 1.7x sooner), in 1/1.45 at 512 x 8 (60%, a step 1.41x
# AdamW's: 1.08x sooner) and in 1/1.27 at 768 x 8 (95%, a step 1.68x AdamW's: AdamW 1.39x sooner,
# beyond both seeds' ranges), ending 7-8% lower in bits per byte each time. So the bound is the largest
# share at which Muon was measured sooner, 60%; with 3 Newton-Schulz steps 768 x 8 comes to 57% (below).
MUON_STEP_BOUND = 1.6


def resolve_optimizer(device_type: str, dtype: str, cpu_flags=frozenset(), param_groups: str = "split",
                      muon_share: float = 0.0, cuda_bf16: bool = True) -> tuple[str, str]:
    """(optimizer name, why) for --optimizer auto, once the run's dtype is known.

    Muon where a Muon step costs at most MUON_STEP_BOUND AdamW steps. That takes two things.
    Newton-Schulz must run in a precision the hardware does natively: fp32 on every CPU, bf16
    on CPUs and GPUs with native bf16 (not fp16 runs, whose Newton-Schulz would be fp32, nor
    emulated bf16: `cpu_flags`, `cuda_bf16`). And its work, `muon_share` of the step's forward and
    backward FLOPs (trainer/metrics.py's muon_flop_share), must stay within the bound: at most
    MUON_STEP_BOUND - 1.
    """
    if param_groups == "single":
        return "adamw", "auto: --param_groups single is AdamW on everything"
    if dtype == "float16":
        return "adamw", ("auto: fp16 on a GPU without native bf16, where Muon's Newton-Schulz would run in fp32, "
                         "far below the fp16 rate of the rest of the step")
    if dtype == "bfloat16" and device_type == "cpu" and not native_bf16_cpu_flags(cpu_flags):
        return "adamw", ("auto: bf16 is emulated on this CPU, where Muon's bf16 Newton-Schulz made a step "
                         "about 6x an AdamW step")
    if dtype == "bfloat16" and device_type == "cuda" and not cuda_bf16:
        return "adamw", "auto: bf16 (typed) is emulated on this GPU, and Newton-Schulz would run in it"
    allowed = MUON_STEP_BOUND - 1
    if muon_share > allowed:
        return "adamw", (f"auto: Muon's Newton-Schulz would add {muon_share:.0%} to each step's FLOPs, over the "
                         f"{allowed:.0%} it may; more tokens per step (--batch_size, --accumulation_steps) lower "
                         f"it, --optimizer muon takes it anyway")
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    return "muon", (f"auto: Newton-Schulz in {precision}, native here, adds {muon_share:.0%} to each step's "
                    f"FLOPs, within the {allowed:.0%} it may")


# Where torch.optim.Muon's 5 Newton-Schulz steps would cost more than the bound, 3 do. At 768 x 8 with 8 x
# 340 tokens a step (95% at 5 steps, 57% at 3; the EPYC, bf16, 2 seeds each), Muon with 3 steps reached
# MiniMind's final loss 1.11x sooner than AdamW on everything at its best lr (62.4 steps against 99.7)
# and ended 0.19 bits per byte lower; with 5 it ended 0.025 lower still, arriving later (1 seed;
# docs/performance.md). At 256 x 4 3 steps were level with 5 (3 seeds).
FEWER_NS_STEPS = 3


def resolve_ns_steps(flag, share_at) -> tuple[int, str | None]:
    """(Newton-Schulz steps, why: None where the flag gave them) for --muon_ns_steps `flag`;
    share_at(steps): Newton-Schulz's share of the step's FLOPs at that many steps (trainer/metrics.py's
    muon_flop_share)."""
    if flag != "auto":
        return flag, None
    allowed, share = MUON_STEP_BOUND - 1, share_at(NS_STEPS)
    if share <= allowed:
        return NS_STEPS, f"auto: torch.optim.Muon's {NS_STEPS} add {share:.0%} to each step's FLOPs, within {allowed:.0%}"
    fewer = share_at(FEWER_NS_STEPS)
    return FEWER_NS_STEPS, (f"auto: {NS_STEPS} steps would add {share:.0%} to each step's FLOPs, over the "
                            f"{allowed:.0%} Muon may, {FEWER_NS_STEPS} add {fewer:.0%}")


def detect_dtype(flag: str, device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """resolve_dtype with this machine's facts."""
    on_cuda = device.type == "cuda"
    return resolve_dtype(flag, device.type, cpu_flags=frozenset() if on_cuda else read_cpu_flags(),
                         cuda_bf16=cuda_has_native_bf16(device) if on_cuda else False, sharded=sharded)


def detect_optimizer(device: torch.device, dtype: str, param_groups: str = "split",
                     muon_share: float = 0.0) -> tuple[str, str]:
    """resolve_optimizer with this machine's facts."""
    on_cuda = device.type == "cuda"
    cpu_flags = frozenset() if on_cuda else read_cpu_flags()
    return resolve_optimizer(device.type, dtype, cpu_flags, param_groups, muon_share,
                             cuda_bf16=cuda_has_native_bf16(device) if on_cuda else True)


# ---------------------------------------------------------------------------- a new run's recipe
# The peak lrs at the widths they were measured at (docs/time-to-quality.md; bench_quality.py, seq
# 340, batch 8, 300 steps), as (hidden size, lr) points. Muon's: at 256 x 4 0.01 beat 0.02 over 3
# seeds and 0.04 lost; at 512 x 8 0.02 beat 0.01 over 2 seeds; at 768 x 8 0.02 beat 0.04 and 0.01,
# 2 seeds each for the best two.
MUON_LR_BY_WIDTH = ((256, 0.01), (512, 0.02), (768, 0.02))
# AdamW's, when it trains everything (--optimizer adamw, or auto's choice of it), the best falling with
# width: at 256 x 4 1.5e-3 beat 7.5e-4, 3e-3 and 6e-3 (2 seeds each); at 512 x 8 3.75e-4 beat 7.5e-4
# and 1.5e-3 (1 seed); at 768 x 8 1.875e-4 beat 3.75e-4, 7.5e-4, 1.5e-3 and 3e-3. Beside Muon it is higher:
ADAMW_LR_BY_WIDTH = ((256, 1.5e-3), (512, 3.75e-4), (768, 1.875e-4))
# where it trains only the embedding (= the tied head) and the norms, neither 1.5e-3 nor 6e-3 beat
# 3e-3 at 256 x 4, and scaling it down with width gained nothing at 512 x 8.
ADAMW_LR_BESIDE_MUON = 3e-3


# Weight decay, AdamW's betas and the document mask by optimizer. With Muon, attention within each packed
# document and weight decay 0.3 reached MiniMind's loss 5 steps sooner and ended 0.054 bits per byte lower
# in distribution and 0.069 out of it (3 seeds at 256 x 4; at 768 x 8 0.076 and 0.06). The mask alone
# won in distribution but lost out of it; so did the pair for AdamW on everything at 768 x 8, whose
# lr (1.875e-4) gives weight decay a sixteenth of its pull at the 3e-3 beside Muon. So AdamW on
# everything keeps torch's 0.01 and attention across the window, with which its lrs were measured.
# Then, with Muon, beta2 0.999 (torch's) for AdamW, which beside Muon trains only the embedding (= the
# tied head) and the norms, with weight decay 0.5: 0.022 bits per byte lower in distribution and 0.025
# out of it than beta2 0.95 and 0.3, every seed lower on both (3 seeds at 256 x 4); 0.006 and 0.021 lower
# at 512 x 8, level in distribution and 0.027 lower out of it at 768 x 8 (2 seeds each), and the quick
# start ended 0.12 lower in validation loss.
# Beta2 0.999 alone won in distribution and lost out of it. AdamW on everything keeps 0.95: 0.999 there
# ended lower on both sets on every seed at 256 x 4 but within the ranges in distribution (3 seeds), and
# reached MiniMind's loss 5.5 steps later at 512 x 8 (1 seed).
WEIGHT_DECAY = {"muon": 0.5, "adamw": 0.01}
DOC_MASK = {"muon": 1, "adamw": 0}
ADAM_BETAS = {"muon": (0.9, 0.999), "adamw": (0.9, 0.95)}


def lr_by_width(points, hidden_size: int) -> float:
    """The lr of `points` ((width, lr), ...) at a measured width, a straight line between two
    measured widths, and the nearest measured width's beyond them (no guess past what was measured)."""
    widths, lrs = zip(*points)
    return float(f"{float(numpy.interp(hidden_size, widths, lrs)):.6g}")


def fresh_recipe(hidden_size: int, optimizer: str) -> dict:
    """A new run's schedule, NorMuon, peak lrs, weight decay, AdamW's betas and document mask under auto for its
    (resolved) optimizer: what beat the older defaults over 3 seeds (docs/time-to-quality.md), with
    the lrs by width."""
    adamw_lr = ADAMW_LR_BESIDE_MUON if optimizer == "muon" else lr_by_width(ADAMW_LR_BY_WIDTH, hidden_size)
    return {"lr_schedule": "wsd", "normuon": 1, "muon_lr": lr_by_width(MUON_LR_BY_WIDTH, hidden_size),
            "learning_rate": adamw_lr, "weight_decay": WEIGHT_DECAY[optimizer], "adam_betas": ADAM_BETAS[optimizer],
            "doc_mask": DOC_MASK[optimizer]}


def resolve_auto(cfg, origin: dict, device, sharded: bool, lm_config, tokens_per_step: int):
    """The TrainConfig with every auto flag decided, each logged once with its reason, and marked
    resolved; rank 0's decisions on every rank (a broadcast). origin: where each flag's value
    came from (trainer/resume_config.py; a flag missing there is a default)."""
    why = {"typed": "--{}", "stored": "the checkpoint's", "default": "this stage's default"}
    reasons = {name: why[origin.get(name, "default")].format(name) for name in AUTO_FLAGS}
    values = {}
    values["dtype"], reasons["dtype"] = detect_dtype(cfg.system.dtype, device, sharded)
    # Newton-Schulz's FLOPs grow with its steps one for one: the model's shapes are read once.
    per_step = muon_flop_share(lm_config, tokens_per_step, cfg.model.max_seq_len, ns_steps=1)
    share_at = lambda steps: steps * per_step  # noqa: E731
    values["muon_ns_steps"], why_steps = resolve_ns_steps(cfg.optim.muon_ns_steps, share_at)
    reasons["muon_ns_steps"] = why_steps or reasons["muon_ns_steps"]  # typed, stored or this stage's
    optimizer = cfg.optim.optimizer
    if optimizer == "auto" and cfg.optim.normuon == 1:  # a NorMuon asked for is Muon asked for
        if cfg.optim.param_groups == "single":
            raise UserError("--normuon 1 changes Muon's update, and --param_groups single is MiniMind's AdamW on "
                            "everything: drop one of them")
        optimizer, reasons["optimizer"] = "muon", f"auto: NorMuon, which is Muon's, is on ({reasons['normuon']})"
    if optimizer == "auto":
        share = share_at(values["muon_ns_steps"])
        optimizer, reasons["optimizer"] = detect_optimizer(device, values["dtype"], cfg.optim.param_groups, share)
    values["optimizer"] = optimizer
    fresh = fresh_recipe(lm_config.hidden_size, optimizer)
    trains = "the embedding and norms beside Muon" if optimizer == "muon" else "everything"
    # The rules that depend on the optimizer say which case applies.
    by_optimizer = "with Muon" if optimizer == "muon" else "for AdamW on everything"
    whose = {"learning_rate": f"AdamW on {trains}", "weight_decay": by_optimizer, "adam_betas": f"AdamW on {trains}",
             "doc_mask": by_optimizer}
    flags = cfg.flags()
    for name in fresh:  # the recipe's flags: an auto one takes the recipe's value
        values[name] = flags[name]
        if values[name] == "auto":
            values[name] = fresh[name]
            what = whose.get(name, "a new run's default")
            reasons[name] = f"auto: {what} at hidden {lm_config.hidden_size} (docs/time-to-quality.md)"
    # NorMuon is Muon's: an auto --normuon gives way to the optimizer (an auto --optimizer gave way to
    # --normuon 1 above). Both given, the combination stops the run in check_config, which names them.
    if optimizer != "muon" and values["normuon"] and cfg.optim.normuon == "auto":
        values["normuon"], reasons["normuon"] = 0, f"--optimizer {optimizer}: NorMuon is Muon's"
    # Each rank read its own hardware; rank 0's reading decides for all (a collective: every rank
    # calls this), so ranks on unlike nodes cannot split into Muon and AdamW, or bf16 and fp32,
    # and then wait on each other's collectives.
    values, reasons = broadcast_from_main((values, reasons))
    for name in AUTO_FLAGS:
        Logger(f"{name}: {values[name]} ({reasons[name]})")
    return dataclasses.replace(cfg.replace(**values), resolved=True)
