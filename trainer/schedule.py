"""The learning-rate schedules, and SCHEDULES, the table --lr_schedule chooses from.

A schedule is a function of (optimizer step from 0, total steps, peak lr, ...) -> lr. Its table
entry calls it with the config's optim group, so a new schedule is a function and one entry:
the flag's choices (trainer/config.py) and every group's lr (trainer/optim.py's set_lr) take it
from the table. Each group follows the schedule from its own peak.
"""
import math

from common.errors import UserError


def cosine_lr(current_step: int, total_steps: int, lr: float, warmup_steps: int = 0,
              min_lr_frac: float = 0.1) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_frac * lr` at `total_steps`. Without
    warmup and at the default floor this is MiniMind's get_lr, to float rounding (it takes the
    cosine of pi times the progress, MiniMind of pi times the step, over the total)."""
    if current_step < warmup_steps:
        return lr * (current_step + 1) / warmup_steps
    progress = min(1.0, (current_step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def wsd_lr(current_step: int, total_steps: int, lr: float, warmup_steps: int = 0, cooldown_frac: float = 0.2,
           min_lr_frac: float = 0.1) -> float:
    """Warmup-stable-decay: cosine_lr's warmup, then `lr` itself until the last `cooldown_frac` of
    the run (never before the warmup ends), then linear to `min_lr_frac * lr` at `total_steps`."""
    if current_step < warmup_steps:
        return lr * (current_step + 1) / warmup_steps
    cooldown_start = max(warmup_steps, total_steps * (1 - cooldown_frac))
    if current_step <= cooldown_start:
        return lr
    span = total_steps - cooldown_start  # > 0 at every step of the run (step < total_steps)
    progress = min(1.0, (current_step - cooldown_start) / span) if span > 0 else 1.0
    return lr * (1 - (1 - min_lr_frac) * progress)


# --lr_schedule's name -> (step, total_steps, peak lr, the config's optim group) -> lr
SCHEDULES = {
    "cosine": lambda step, total, lr, optim: cosine_lr(step, total, lr, optim.warmup_steps, optim.min_lr_frac),
    "wsd": lambda step, total, lr, optim: wsd_lr(step, total, lr, optim.warmup_steps, optim.cooldown_frac,
                                                 optim.min_lr_frac),
}


def schedule(name: str):
    """The table's schedule of that name; any other name stops the run (never a silent default)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise UserError(f"--lr_schedule {name}: no such schedule (one of {', '.join(SCHEDULES)})") from None
