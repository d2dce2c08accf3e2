"""The optimizer side of training: parameter groups, AdamW or Muon + AdamW, and the
per-group learning-rate schedule.

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
    compile_ns: bool = False        # compile Muon's Newton-Schulz (CUDA)
    fused: bool = True              # fused AdamW (CPU and CUDA); off for the exact-reference tests

    @classmethod
    def from_args(cls, args, settings, device) -> "OptimConfig":
        """`settings`: the run's RunSettings (--optimizer and --dtype as resolved, never auto)."""
        return cls(optimizer=settings.optimizer, param_groups=args.param_groups, lr=args.learning_rate,
                   weight_decay=args.weight_decay, betas=args.adam_betas, muon_lr=args.muon_lr,
                   muon_momentum=args.muon_momentum,
                   ns_dtype="bfloat16" if settings.dtype == "bfloat16" else "float32",
                   compile_ns=device.type == "cuda")


def check_optim_args(args):
    if args.optimizer == "muon" and args.param_groups == "single":
        raise UserError("--param_groups single is MiniMind's AdamW-on-everything recipe; "
                        "with --optimizer muon drop it (or pass --optimizer adamw)")


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
    return {"muon": cfg.muon_lr, "decay": cfg.lr, "no_decay": cfg.lr, "all": cfg.lr}


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
    # Fused AdamW runs on CPU and CUDA tensors alike (torch >= 2.4); one kernel per step.
    optimizers = [torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=cfg.betas, fused=cfg.fused)]
    if muon_groups:
        optimizers.append(Muon(muon_groups, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                               ns_dtype=getattr(torch, cfg.ns_dtype), process_group=data_parallel_group,
                               compile_ns=cfg.compile_ns))
    return Optimizers(optimizers)


def describe(optimizer: Optimizers, peaks: dict) -> str:
    """One line: each group's optimizer, size, peak lr and decay."""
    parts = []
    for opt in optimizer:
        for g in opt.param_groups:
            n = sum(p.numel() for p in g["params"])
            parts.append(f"{g['name']} ({type(opt).__name__}, {n / 1e6:.2f}M params, lr {peaks[g['name']]:.1e}, "
                         f"wd {g['weight_decay']:g})")
    return "optimizer: " + "; ".join(parts)


# ---------------------------------------------------------------------------- schedule
def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of optimizer step `step` (from 0) for a peak of `lr`: linear warmup to
    `lr`, then cosine decay to `min_lr_ratio * lr` at `total_steps`. Without warmup this is
    MiniMind's get_lr (trainer/trainer_utils.py exports it under that name)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, peaks: dict, step: int, total_steps: int, warmup_steps: int) -> dict:
    """Schedule every group from its own peak; returns {group name: lr} for the log."""
    for group in optimizer.param_groups:
        group["lr"] = get_lr(step, total_steps, peaks[group["name"]], warmup_steps)
    return {group["name"]: group["lr"] for group in optimizer.param_groups}
