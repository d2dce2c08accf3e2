"""Decoupled weight decay, plain or cautious, for Muon (trainer/muon.py) and AdamW
(trainer/adamw.py). With a step W <- W - lr * U (U: the optimizer's update direction):

    plain     W <- W * (1 - lr * weight_decay) everywhere
    cautious  the same, but only where U and W agree in sign (Cautious Weight Decay, Chen
              et al., 2025): where the step already moves W towards 0. Elsewhere the step
              moves W away from 0, and decay would only pull against what the loss asks for.

The rate is lr * weight_decay with the scheduled lr, so either decay follows the schedule.
"""
import torch


def cautious_mask(update: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Where the update and the weight agree in sign (a zero agrees only with a zero)."""
    return update.sign() == weight.sign()


def decay_(weights: list, rate: float, updates: list | None = None):
    """W <- W * (1 - rate) for each weight, in place; with `updates` (each weight's U), only
    where cautious_mask holds. Where it holds, the product is the plain decay's, bit for bit."""
    if not rate:
        return
    if updates is None:
        torch._foreach_mul_(weights, 1 - rate)
        return
    for weight, update in zip(weights, updates):
        weight.mul_(torch.where(cautious_mask(update, weight), 1 - rate, 1.0))
