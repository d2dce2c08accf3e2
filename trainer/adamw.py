"""AdamW written out, for cautious weight decay on the AdamW groups (--cautious_wd adamw or
both): its mask needs the update direction before the decay is applied, which
torch.optim.AdamW's kernels never show. Every other run keeps torch's fused AdamW.

The update is torch.optim.AdamW's (decoupled decay, bias-corrected moments, eps outside the root):

    m <- lerp(m, g, 1 - beta1)                 v <- beta2 v + (1 - beta2) g^2
    U  = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    W <- decay(W) - lr * U                     decay: plain or cautious (trainer/weight_decay.py)

Its param groups and state ("step", "exp_avg", "exp_avg_sq") are torch's, so a checkpoint of
either loads into the other. Elementwise throughout: under FSDP each rank updates its shard,
under DDP every rank the same bits.
"""
import torch

from trainer.parallel import local_part
from trainer.weight_decay import decay_


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 *, cautious_wd: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.cautious_wd = cautious_wd

    @torch.no_grad()
    def step(self, closure=None):
        """Every parameter with a gradient takes a step. No closure: nothing here passes one."""
        if closure is not None:
            raise NotImplementedError("this AdamW takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)

    def _step_param(self, p, group: dict):
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        weight, grad = local_part(p), local_part(p.grad)
        m, v = local_part(state["exp_avg"]), local_part(state["exp_avg_sq"])
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
        decay_([weight], group["lr"] * group["weight_decay"], [update] if self.cautious_wd else None)
        weight.add_(update, alpha=-group["lr"])
