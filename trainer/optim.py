"""The optimizer side of training: parameter groups, AdamW or Muon + AdamW, and the
per-group learning-rate schedule (with Muon's momentum).

Groups (each carries a "name"; its peak lr comes from peak_lrs):
    decay      2-D AdamW weights (embedding = tied output head; with AdamW alone, every matrix)
    no_decay   norms and other 1-D parameters: AdamW without weight decay (nanoGPT's rule);
               decaying a norm's gain towards 0 only fights the weights that follow it
    muon       with --optimizer muon, the 2-D matrices inside the transformer blocks (trainer/muon.py)
    all        --param_groups single: MiniMind's recipe, AdamW on everything with one decay
"""
import math
from dataclasses import dataclass

import torch

from common.errors import UserError
from trainer.adamw import AdamW
from trainer.muon import Muon


# ---------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"        # adamw | muon (--optimizer auto is resolved before this)
    param_groups: str = "split"     # split (no decay on 1-D) | single (MiniMind: one group, one decay)
    lr: float = 5e-4                # AdamW peak
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.95)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    ns_dtype: str = "float32"       # Muon's Newton-Schulz: the run's precision (bfloat16 under bf16 autocast)
    compile_update: bool = False    # compile Muon's per-matrix arithmetic: Newton-Schulz, NorMuon (CUDA)
    fused: bool = True              # fused AdamW (CPU and CUDA); off for the exact-reference tests
    # Options, each off here (the schedule: MiniMind's cosine); the flags' defaults: trainer/args.py.
    muon_ns: str = "quintic"        # quintic | polar_express (trainer/newton_schulz.py)
    normuon: bool = False
    normuon_beta2: float = 0.95
    cautious_wd: str = "none"       # none | muon | adamw | both (trainer/weight_decay.py)
    warmup_steps: int = 0
    lr_schedule: str = "cosine"     # cosine (MiniMind's get_lr) | wsd
    cooldown_frac: float = 0.2      # wsd: the last share of the run, a linear cooldown
    min_lr_frac: float = 0.1        # both: the floor, a share of each group's peak
    muon_momentum_warmup: int = 0   # steps from MOMENTUM_START to muon_momentum
    lr_ref_width: int = 0           # AdamW peaks x (hidden_size / lr_ref_width) ** -0.5 (0: off)
    hidden_size: int = 0            # the model's width, for lr_ref_width

    @classmethod
    def from_args(cls, args, settings, device, hidden_size: int) -> "OptimConfig":
        """`settings`: the run's RunSettings (--optimizer and --dtype as resolved, never auto);
        hidden_size: the model's (the config's: --from_weight's may decide it)."""
        return cls(optimizer=settings.optimizer, param_groups=args.param_groups, lr=args.learning_rate,
                   weight_decay=args.weight_decay, betas=args.adam_betas, muon_lr=settings.muon_lr,
                   muon_momentum=args.muon_momentum,
                   ns_dtype="bfloat16" if settings.dtype == "bfloat16" else "float32",
                   compile_update=device.type == "cuda", muon_ns=args.muon_ns, normuon=bool(settings.normuon),
                   normuon_beta2=args.normuon_beta2, cautious_wd=args.cautious_wd, warmup_steps=args.warmup_steps,
                   lr_schedule=settings.lr_schedule, cooldown_frac=args.cooldown_frac, min_lr_frac=args.min_lr_frac,
                   muon_momentum_warmup=args.muon_momentum_warmup, lr_ref_width=args.lr_ref_width,
                   hidden_size=hidden_size)


def check_optim_args(args):
    if args.optimizer == "muon" and args.param_groups == "single":
        raise UserError("--param_groups single is MiniMind's AdamW-on-everything recipe; "
                        "with --optimizer muon drop it (or pass --optimizer adamw)")
    if args.optimizer == "adamw":  # Muon's options would change nothing, silently
        muon_only = [("muon_ns", args.muon_ns != "quintic"), ("normuon", args.normuon == 1),
                     ("muon_momentum_warmup", args.muon_momentum_warmup > 0),
                     ("cautious_wd", args.cautious_wd in ("muon", "both"))]
        for flag, on in muon_only:
            if on:
                raise UserError(f"--{flag} {getattr(args, flag)} changes Muon's update, and --optimizer adamw "
                                f"trains without Muon: drop it (or pass --optimizer muon or auto)")


def is_block_matrix(name: str, param) -> bool:
    """A 2-D weight inside a transformer block: Muon's share. Embedding/head stay on AdamW."""
    return param.ndim == 2 and ".layers." in f".{name}"


def param_groups(model, cfg: OptimConfig) -> list[dict]:
    """The named groups of the module docstring; empty groups are left out."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights appear once
    if cfg.param_groups == "single":
        groups = [("all", [p for _, p in named], cfg.weight_decay, cfg.lr)]
    else:
        muon = [p for n, p in named if cfg.optimizer == "muon" and is_block_matrix(n, p)]
        taken = {id(p) for p in muon}
        groups = [("muon", muon, cfg.weight_decay, cfg.muon_lr),
                  ("decay", [p for _, p in named if p.ndim >= 2 and id(p) not in taken], cfg.weight_decay, cfg.lr),
                  ("no_decay", [p for _, p in named if p.ndim < 2], 0.0, cfg.lr)]
    return [{"name": name, "params": params, "weight_decay": wd, "lr": lr}
            for name, params, wd, lr in groups if params]


def peak_lrs(cfg: OptimConfig) -> dict:
    """Each group's peak lr. Kept out of the param groups (which a checkpoint restores),
    so a resumed run follows this run's flags."""
    adamw = cfg.lr * adamw_width_scale(cfg)
    return {"muon": cfg.muon_lr, "decay": adamw, "no_decay": adamw, "all": adamw}


def adamw_width_scale(cfg: OptimConfig) -> float:
    """With lr_ref_width W, the AdamW groups' peaks scale as (hidden_size / W) ** -0.5: nanochat's
    rule (its W is 768), as the embedding's best lr falls with the width; ours were tuned at
    hidden 256. Muon's lr needs no such rule (its update has the matrix's own scale). 1 when off."""
    if not cfg.lr_ref_width:
        return 1.0
    if cfg.hidden_size <= 0:
        raise ValueError("lr_ref_width needs the model's hidden_size in the OptimConfig")
    return (cfg.hidden_size / cfg.lr_ref_width) ** -0.5


class Optimizers:
    """Several optimizers used as one: step, zero_grad, param_groups and state span them all.

    GradScaler sees one object with every group (unscale_ and step work unchanged), and
    it iterates as the list of optimizers it is, which is the form torch.distributed's
    get_state_dict/set_state_dict take, so checkpoints hold every optimizer by parameter name.
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]):
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)


def build_optimizer(model, cfg: OptimConfig, data_parallel_group=None) -> Optimizers:
    """AdamW over the AdamW groups, plus Muon over the block matrices. `data_parallel_group`:
    the DDP ranks, which share Muon's Newton-Schulz work (FSDP's sharded parameters carry their own)."""
    groups = param_groups(model, cfg)
    adamw_groups = [g for g in groups if g["name"] != "muon"]
    muon_groups = [g for g in groups if g["name"] == "muon"]
    if cfg.cautious_wd in ("adamw", "both"):
        adamw = AdamW(adamw_groups, lr=cfg.lr, betas=cfg.betas, cautious_wd=True)
    else:  # fused AdamW runs on CPU and CUDA tensors alike (torch >= 2.4); one kernel per step
        adamw = torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=cfg.betas, fused=cfg.fused)
    optimizers = [adamw]
    if muon_groups:
        optimizers.append(Muon(muon_groups, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                               ns_dtype=getattr(torch, cfg.ns_dtype), process_group=data_parallel_group,
                               compile_update=cfg.compile_update, ns_method=cfg.muon_ns, normuon=cfg.normuon,
                               normuon_beta2=cfg.normuon_beta2, cautious_wd=cfg.cautious_wd in ("muon", "both")))
    return Optimizers(optimizers)


def describe(optimizer: Optimizers, cfg: OptimConfig) -> str:
    """One line: each group's optimizer, size, peak lr and decay, then the options on beyond
    plain Muon / AdamW and the cosine."""
    peaks, parts = peak_lrs(cfg), []
    for opt in optimizer:
        for g in opt.param_groups:
            n = sum(p.numel() for p in g["params"])
            parts.append(f"{g['name']} ({type(opt).__name__}, {n / 1e6:.2f}M params, lr {peaks[g['name']]:.1e}, "
                         f"wd {g['weight_decay']:g})")
    return "optimizer: " + "; ".join(parts + _options_on(cfg))


def _options_on(cfg: OptimConfig) -> list[str]:
    """The options on in `cfg` beyond plain Muon / AdamW and the cosine, for the start-up line."""
    on = []
    if cfg.lr_ref_width:
        on.append(f"AdamW peaks x{adamw_width_scale(cfg):.3f} = ({cfg.hidden_size} / {cfg.lr_ref_width}) ** -0.5 "
                  f"(--lr_ref_width)")
    if cfg.optimizer == "muon" and cfg.muon_ns != "quintic":
        on.append(f"Newton-Schulz {cfg.muon_ns}")
    if cfg.optimizer == "muon" and cfg.normuon:
        on.append(f"NorMuon (beta2 {cfg.normuon_beta2:g})")
    if cfg.optimizer == "muon" and cfg.muon_momentum_warmup:
        on.append(f"Muon momentum {MOMENTUM_START:g} to {cfg.muon_momentum:g} over {cfg.muon_momentum_warmup} steps")
    if cfg.cautious_wd != "none":
        on.append(f"cautious weight decay ({cfg.cautious_wd})")
    if cfg.lr_schedule == "wsd":
        on.append(f"lr schedule wsd (cooldown over the last {cfg.cooldown_frac:.0%})")
    if cfg.min_lr_frac != OptimConfig.min_lr_frac:
        on.append(f"lr floor {cfg.min_lr_frac:g} of each peak")
    return on


# ---------------------------------------------------------------------------- schedule
def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of optimizer step `step` (from 0) for a peak of `lr`: linear warmup to
    `lr`, then cosine decay to `min_lr_ratio * lr` at `total_steps`. Without warmup this is
    MiniMind's get_lr (trainer/trainer_utils.py exports it under that name)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def wsd_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, cooldown_frac: float = 0.2,
           min_lr_ratio: float = 0.1) -> float:
    """Warmup-stable-decay: get_lr's warmup, then `lr` itself until the last `cooldown_frac` of
    the run (never before the warmup ends), then linear to `min_lr_ratio * lr` at `total_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    cooldown_start = max(warmup_steps, total_steps * (1 - cooldown_frac))
    if step <= cooldown_start:
        return lr
    span = total_steps - cooldown_start  # > 0 at every step of the run (step < total_steps)
    progress = min(1.0, (step - cooldown_start) / span) if span > 0 else 1.0
    return lr * (1 - (1 - min_lr_ratio) * progress)


MOMENTUM_START = 0.85  # where --muon_momentum_warmup starts Muon's momentum (modded-nanogpt's)


def muon_momentum(step: int, target: float, warmup_steps: int) -> float:
    """Muon's momentum at step `step`: linear from MOMENTUM_START at step 0 to `target` at
    `warmup_steps`, then `target` (always, without a warmup)."""
    if step >= warmup_steps:
        return target
    return MOMENTUM_START + (target - MOMENTUM_START) * step / warmup_steps


@dataclass(frozen=True)
class Schedule:
    """Every group's lr, and Muon's momentum, as functions of the optimizer step alone. set_lr
    writes them into the param groups before every step, over what a checkpoint restored
    there, so a checkpoint needs nothing of them and a resumed run follows its own flags."""
    peaks: dict                     # each group's peak lr (peak_lrs)
    warmup_steps: int = 0
    kind: str = "cosine"            # cosine (get_lr) | wsd (wsd_lr)
    cooldown_frac: float = 0.2
    min_lr_frac: float = 0.1
    muon_momentum: float = 0.95
    momentum_warmup: int = 0

    @classmethod
    def of(cls, cfg: OptimConfig) -> "Schedule":
        return cls(peak_lrs(cfg), cfg.warmup_steps, cfg.lr_schedule, cfg.cooldown_frac, cfg.min_lr_frac,
                   cfg.muon_momentum, cfg.muon_momentum_warmup)

    def lr(self, group: str, step: int, total_steps: int) -> float:
        peak = self.peaks[group]
        if self.kind == "wsd":
            return wsd_lr(step, total_steps, peak, self.warmup_steps, self.cooldown_frac, self.min_lr_frac)
        return get_lr(step, total_steps, peak, self.warmup_steps, self.min_lr_frac)


def set_lr(optimizer, schedule: Schedule, step: int, total_steps: int) -> dict:
    """Schedule every group from its own peak, and Muon's momentum; returns {group name: lr} for the log."""
    for group in optimizer.param_groups:
        group["lr"] = schedule.lr(group["name"], step, total_steps)
        if group["name"] == "muon":
            group["momentum"] = muon_momentum(step, schedule.muon_momentum, schedule.momentum_warmup)
    return {group["name"]: group["lr"] for group in optimizer.param_groups}
