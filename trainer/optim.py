"""The optimizer side of training, in one file: parameter groups, AdamW and Muon (with its
Newton-Schulz iteration and NorMuon), and each group's learning rate at a step (set_lr, from the
schedules of trainer/schedule.py).

Groups (each carries a "name"; its peak lr is peak_lr's):
    muon       with Muon, the 2-D matrices inside the transformer blocks
    decay      the other 2-D weights, AdamW's (the embedding = tied head; without Muon, every matrix)
    no_decay   norms and other 1-D parameters: AdamW without decay, which would only pull a norm's
               gain towards 0 against the weights that follow it (nanoGPT's rule)
    all        --param_groups single: MiniMind's recipe, AdamW on everything with one decay

Muon updates a matrix W with gradient G as torch.optim.Muon does:

    B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum)       momentum, Nesterov's look-ahead
    O <- NewtonSchulz5(U / |U|)                                      close to the nearest orthogonal matrix
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

NorMuon (--normuon 1) then evens O's rows: each is divided by the root of its running mean
square v (per row, in the state as "row_second_moment"), and the result is scaled back to O's
norm. What this file adds to torch's Muon: O batched by shape and split across ranks
(trainer/muon_ranks.py); in the run's precision (bf16 under bf16 autocast, fp32 in an fp32 run,
which stays the same run at any world size to float noise; torch's is always bf16); and compiled
on CUDA (the iteration and NorMuon's arithmetic, which see no learning rate). Its param groups and state
are torch.optim.Muon's key for key, so a checkpoint of either resumes with this one.
"""
import math

import torch
from torch.distributed.tensor import DTensor

from trainer.distributed import local_part
from trainer.muon_ranks import every_rank_rows, orthogonalise
from trainer.schedule import schedule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's
NS_STEPS = 5
EPS = 1e-7
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10  # added to v (about 1 / max(rows, cols)): keeps an all-zero row's root finite
MUON_MOMENTUM = 0.95


# ---------------------------------------------------------------------------- groups and optimizers
def is_block_matrix(name: str, param) -> bool:
    """A 2-D weight inside a transformer block: Muon's share. Embedding/head stay on AdamW."""
    return param.ndim == 2 and ".layers." in f".{name}"


def param_groups(model, optimizer: str, param_groups: str, weight_decay: float) -> list[dict]:
    """The named groups of the module docstring; empty groups are left out. Their lr is set
    before every step (set_lr)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights appear once
    if param_groups == "single":
        groups = [("all", [p for _, p in named], weight_decay)]
    else:
        muon = [p for n, p in named if optimizer == "muon" and is_block_matrix(n, p)]
        taken = {id(p) for p in muon}
        groups = [("muon", muon, weight_decay),
                  ("decay", [p for _, p in named if p.ndim >= 2 and id(p) not in taken], weight_decay),
                  ("no_decay", [p for _, p in named if p.ndim < 2], 0.0)]
    return [{"name": name, "params": params, "weight_decay": wd} for name, params, wd in groups if params]


class Optimizers(list):
    """AdamW and Muon as one optimizer (for GradScaler, the loop, the schedule), and the list of
    them that torch.distributed's get_state_dict takes: checkpoints hold both by parameter name."""

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self for p, s in opt.state.items()}

    def step(self):
        for opt in self:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)


def build_optimizer(model, optim, ns_dtype: torch.dtype = torch.float32, compile_update: bool = False,
                    replica_group=None, fused: bool = True) -> Optimizers:
    """AdamW (torch's fused one) over the AdamW groups, Muon over the block matrices. `optim`: the
    config's resolved optim group; `replica_group`: the DDP ranks, which share Muon's work."""
    groups = param_groups(model, optim.optimizer, optim.param_groups, optim.weight_decay)
    adamw = torch.optim.AdamW([g for g in groups if g["name"] != "muon"], lr=optim.learning_rate,
                              betas=optim.adam_betas, fused=fused)
    optimizers = Optimizers([adamw])
    muon_groups = [g for g in groups if g["name"] == "muon"]
    if muon_groups:
        optimizers.append(Muon(muon_groups, lr=optim.muon_lr, weight_decay=optim.weight_decay, ns_dtype=ns_dtype,
                               ns_steps=optim.muon_ns_steps, process_group=replica_group,
                               compile_update=compile_update, normuon=bool(optim.normuon)))
    return optimizers


def describe(optimizer: Optimizers, optim) -> str:
    """One line: each group's optimizer, size, peak lr and decay, then the schedule."""
    parts = []
    for opt in optimizer:
        for g in opt.param_groups:
            n = sum(p.numel() for p in g["params"])
            steps = f", {g['ns_steps']} Newton-Schulz steps" if "ns_steps" in g else ""
            parts.append(f"{g['name']} ({type(opt).__name__}, {n / 1e6:.2f}M params, lr "
                         f"{peak_lr(g['name'], optim):.1e}, wd {g['weight_decay']:g}{steps})")
    if optim.optimizer == "muon" and optim.normuon:
        parts.append(f"NorMuon (beta2 {NORMUON_BETA2:g})")
    cooldown = f", cooldown over the last {optim.cooldown_frac:.0%}" if optim.lr_schedule == "wsd" else ""
    parts.append(f"lr schedule {optim.lr_schedule} ({optim.warmup_steps} warmup steps{cooldown}, floor "
                 f"{optim.min_lr_frac:g} of each peak)")
    return "optimizer: " + "; ".join(parts)


# ---------------------------------------------------------------------------- each group's learning rate
def peak_lr(group: str, optim) -> float:
    return optim.muon_lr if group == "muon" else optim.learning_rate


def set_lr(optimizer, optim, step: int, total_steps: int) -> dict:
    """Every group's lr at `step` from its own peak, over whatever a checkpoint restored there,
    so that a resumed run follows its config. Returns {group name: lr} for the log."""
    lr_at = schedule(optim.lr_schedule)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, total_steps, peak_lr(group["name"], optim), optim)
    return {group["name"]: group["lr"] for group in optimizer.param_groups}


# ---------------------------------------------------------------------------- Muon
def newton_schulz(x, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = EPS):
    """Orthogonalise each matrix of a (k, m, n) stack with m <= n: scaled to Frobenius norm 1,
    so every singular value s lies in (0, 1], then `steps` times X <- aX + (bA + cA^2)X, A = XX^T,
    which applies the odd quintic a s + b s^3 + c s^5 to every singular value."""
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def newton_schulz_flops(shapes, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of one orthogonalisation of matrices of these shapes, taken wide (m <= n):
    per step X X^T (2m^2n), A A (2m^3) and B X (2m^2n)."""
    return sum(steps * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)


def adjusted_lr(lr: float, shape) -> float:
    """torch.optim.Muon's default ("original") scale: tall matrices take larger steps."""
    rows, cols = shape
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, batched, split over `process_group` (the ranks whose gradients
    DDP has averaged; None: this process does all the work; FSDP2 parameters bring their mesh's)
    and in `ns_dtype`, with NorMuon as an option."""

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = MUON_MOMENTUM,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn=None, *, ns_dtype: torch.dtype = torch.float32, process_group=None,
                 compile_update: bool = False, normuon: bool = False):
        if adjust_lr_fn not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: only torch.optim.Muon's default (None) is implemented")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        self.ns_dtype, self.process_group, self.normuon = ns_dtype, process_group, normuon
        # Compiled on CUDA, where launching their many small ops one by one costs more than the arithmetic.
        maybe_compile = (lambda fn: torch.compile(fn, dynamic=False)) if compile_update else (lambda fn: fn)
        self._newton_schulz = maybe_compile(newton_schulz)
        self._row_stats, self._rescale = maybe_compile(row_stats), maybe_compile(rescale)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list):
        grads = [local_part(p.grad) for p in params]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buffers = [local_part(self.state[p]["momentum_buffer"]) for p in params]
        momentum = group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        run = lambda x: self._newton_schulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
        orthogonal = orthogonalise(params, updates, run, self.ns_dtype, self.process_group)
        if self.normuon:
            figures, inv_rms = self._row_stats(orthogonal, [self._row_moment(p) for p in params], NORMUON_BETA2)
            orthogonal = self._rescale(orthogonal, inv_rms, every_rank_rows(params, figures))
        lr, weights = group["lr"], [local_part(p) for p in params]
        if group["weight_decay"]:
            torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
        for p, weight, update in zip(params, weights, orthogonal):
            weight.add_(update, alpha=-adjusted_lr(lr, p.shape))

    def _row_moment(self, p):
        """NorMuon's v of p, one per row, held as p is: whole, or under FSDP p's rows of it (a
        DTensor sharded as p, so that checkpoints save and reshard it with p). Its local part."""
        state = self.state[p]
        if "row_second_moment" not in state:
            v = torch.zeros(local_part(p).shape[0], dtype=torch.float32, device=local_part(p).device)
            if isinstance(p, DTensor):
                v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=(p.shape[0],),
                                       stride=(1,))
            state["row_second_moment"] = v
        return local_part(state["row_second_moment"])


# NorMuon's rescaling of each O (whole, or the rows this rank holds), in two halves, so that the
# norms between them can take in every rank's rows under FSDP.
def row_stats(updates, moments, beta2: float):
    """v <- lerp(v, mean(O_row^2), 1 - beta2) in place, for each matrix's `moments`; returns, per
    matrix, its rows' (|O_row|^2, |O_row / sqrt(v + eps)|^2) as a (rows, 2) tensor, and 1 / sqrt(v + eps)."""
    row_squares = [u.float().square().contiguous().sum(dim=-1) for u in updates]
    for v, squares, u in zip(moments, row_squares, updates):
        v.lerp_(squares / u.shape[-1], 1 - beta2)
    inv_rms = [(v + NORMUON_EPS).rsqrt() for v in moments]
    figures = [torch.stack([sq, sq * s.square()], dim=1) for sq, s in zip(row_squares, inv_rms)]
    return figures, inv_rms


def rescale(updates, inv_rms, figures) -> list:
    """Each O's rows times its inv_rms, times |O| / |O / sqrt(v + eps)| summed from `figures` over
    all the matrix's rows (here, or under FSDP every rank's: muon_ranks' every_rank_rows)."""
    norms = [f.sum(dim=0) for f in figures]
    # An all-zero O (a zero gradient) has both norms 0: the clamp keeps its update 0, not NaN.
    scales = [s * (before / after.clamp(min=1e-30)).sqrt() for s, (before, after) in zip(inv_rms, norms)]
    return [u * scale.unsqueeze(-1) for u, scale in zip(updates, scales)]
