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
norm. What this file adds to torch's Muon is where and how O is computed: batched (every matrix
taken wide, so each layer's q/o, k/v and MLP matrices fall into three stacks, one batched
iteration each); split across ranks (matrix i of a stack of n is rank i // ceil(n / W)'s: under
DDP one all-gather then hands every rank every result, so the replicas stay bitwise equal; under
FSDP2 one all-to-all brings each owner the rows of its matrices and a second returns every rank
its rows); in the run's precision (bf16 under bf16 autocast, fp32 in an fp32 run, which stays
the same run at any world size to float noise; torch's is always bf16); and compiled on CUDA
(the iteration and NorMuon's arithmetic, which see no learning rate). Its param groups and state
are torch.optim.Muon's key for key, so a checkpoint of either resumes with this one.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from trainer.distributed import local_part
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


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of each rank's FSDP2 shard of a matrix (torch.chunk along dim 0; the last ones may be empty)."""
    per_rank = -(-rows // world_size)
    return [max(0, min(per_rank, rows - rank * per_rank)) for rank in range(world_size)]


@dataclass(frozen=True)
class Stack:
    """Matrices of one oriented shape (m <= n), in parameter order."""
    shape: tuple  # (m, n)
    members: tuple  # indices into the step's parameter list
    transposed: tuple  # whether each member is taken transposed

    def per_rank(self, world_size: int) -> int:
        return -(-len(self.members) // world_size)

    def owner_of(self, position: int, world_size: int) -> int:
        return position // self.per_rank(world_size)

    def owned(self, rank: int, world_size: int) -> range:
        """Positions in the stack that `rank` orthogonalises."""
        k = self.per_rank(world_size)
        return range(min(rank * k, len(self.members)), min((rank + 1) * k, len(self.members)))


def stacks_of(shapes) -> list[Stack]:
    """Group matrices by their shape taken wide (rows <= cols), in order of first appearance."""
    groups = {}
    for i, (rows, cols) in enumerate(shapes):
        groups.setdefault((min(rows, cols), max(rows, cols)), []).append((i, rows > cols))
    return [Stack(key, tuple(i for i, _ in members), tuple(t for _, t in members)) for key, members in groups.items()]


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
        orthogonal = self._orthogonalise(params, updates, group)
        if self.normuon:
            figures, inv_rms = self._row_stats(orthogonal, [self._row_moment(p) for p in params], NORMUON_BETA2)
            orthogonal = self._rescale(orthogonal, inv_rms, _every_rank_rows(params, figures))
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

    def _orthogonalise(self, params, updates, group) -> list:
        """O for every parameter, each in the layout this rank holds it (whole, or its FSDP rows)."""
        stacks = stacks_of([tuple(p.shape) for p in params])
        run = lambda x: self._newton_schulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
        if isinstance(params[0], DTensor):
            return _orthogonalise_fsdp(params, updates, stacks, run, self.ns_dtype)
        pg = self.process_group
        if pg is None or dist.get_world_size(pg) == 1:
            return _orthogonalise_here(updates, stacks, run, self.ns_dtype)
        return _orthogonalise_ddp(updates, stacks, run, self.ns_dtype, pg)


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
    all the matrix's rows (here, or under FSDP every rank's: _every_rank_rows)."""
    norms = [f.sum(dim=0) for f in figures]
    # An all-zero O (a zero gradient) has both norms 0: the clamp keeps its update 0, not NaN.
    scales = [s * (before / after.clamp(min=1e-30)).sqrt() for s, (before, after) in zip(inv_rms, norms)]
    return [u * scale.unsqueeze(-1) for u, scale in zip(updates, scales)]


def _every_rank_rows(params, figures) -> list:
    """Each matrix's per-row `figures` for all its rows, the same bits on every layout (under FSDP
    each rank sets its rows among zeros, and one all-reduce fills in every rank's)."""
    if not isinstance(params[0], DTensor):
        return figures
    pg = _mesh_group(params[0])
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    rows = [p.shape[0] for p in params]
    full = figures[0].new_zeros(sum(rows), figures[0].shape[1])
    start = 0
    for p, block in zip(params, figures):
        mine = start + sum(shard_rows(p.shape[0], world)[:rank])
        full[mine:mine + block.shape[0]] = block
        start += p.shape[0]
    dist.all_reduce(full, group=pg)
    return list(full.split(rows))


def _oriented(matrix, transposed: bool):
    return matrix.mT if transposed else matrix


def _stack(updates, stack: Stack, positions, dtype, pad_to: int = 0):
    """The members at `positions`, oriented wide, as one (max(len, pad_to), m, n) tensor (zeros pad it)."""
    rows = [_oriented(updates[stack.members[j]], stack.transposed[j]).to(dtype) for j in positions]
    if pad_to > len(rows):
        like = updates[stack.members[0]]
        rows += [torch.zeros(stack.shape, dtype=dtype, device=like.device)] * (pad_to - len(rows))
    return torch.stack(rows)


def _orthogonalise_here(updates, stacks, run, dtype) -> list:
    out = [None] * len(updates)
    for stack in stacks:
        result = run(_stack(updates, stack, range(len(stack.members)), dtype))
        for j, i in enumerate(stack.members):
            out[i] = _oriented(result[j], stack.transposed[j])
    return out


def _orthogonalise_ddp(updates, stacks, run, dtype, pg) -> list:
    """Each rank orthogonalises its share of every stack; one all-gather hands every rank all of them."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    mine = [run(_stack(updates, s, s.owned(rank, world), dtype, pad_to=s.per_rank(world))) for s in stacks]
    send = torch.cat([m.reshape(-1) for m in mine])
    gathered = send.new_empty(world * send.numel())
    # torch 2.13 renamed all_gather_into_tensor; a GPU image may have an older torch.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, send, group=pg)
    gathered = gathered.view(world, -1)
    out, offset = [None] * len(updates), 0
    for stack, block in zip(stacks, mine):
        k, (m, n) = stack.per_rank(world), stack.shape
        every = gathered[:, offset:offset + block.numel()].reshape(world * k, m, n)
        offset += block.numel()
        for j, i in enumerate(stack.members):
            out[i] = _oriented(every[j], stack.transposed[j])
    return out


def _orthogonalise_fsdp(params, updates, stacks, run, dtype) -> list:
    """FSDP2 (every rank holds rows of every matrix, Shard(0)): all-to-all #1 brings each owner
    all rows of its matrices; it orthogonalises them whole; all-to-all #2 returns every rank its rows."""
    pg = _mesh_group(params[0])
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    rows = [shard_rows(p.shape[0], world) for p in params]
    for p, u, r in zip(params, updates, rows):
        if u.shape[0] != r[rank]:
            raise ValueError(f"an FSDP shard of {tuple(p.shape)} has {u.shape[0]} rows on rank {rank}, "
                             f"expected {r[rank]} (dim-0 sharding in torch.chunk's sizes)")
    owner = [0] * len(params)
    for stack in stacks:
        for j, i in enumerate(stack.members):
            owner[i] = stack.owner_of(j, world)
    owned_by = [[i for i in range(len(params)) if owner[i] == r] for r in range(world)]
    mine = owned_by[rank]
    exchange = _RowExchange(rows, [p.shape[1] for p in params], dtype, updates[0].device, pg)
    got = exchange({(i, rank): updates[i] for i in range(len(params))},
                   send_plan=[[(i, rank) for i in owned_by[dst]] for dst in range(world)],
                   recv_plan=[[(i, src) for i in mine] for src in range(world)])
    whole = {i: torch.cat([got[(i, src)] for src in range(world)]) for i in mine}
    result = {}
    for stack in stacks:
        positions = list(stack.owned(rank, world))
        if positions:
            batch = run(_stack(whole, stack, positions, dtype))
            for b, j in enumerate(positions):
                result[stack.members[j]] = _oriented(batch[b], stack.transposed[j])
    got = exchange({(i, dst): _rows_of(result[i], rows[i], dst) for i in mine for dst in range(world)},
                   send_plan=[[(i, dst) for i in mine] for dst in range(world)],
                   recv_plan=[[(i, rank) for i in owned_by[src]] for src in range(world)])
    return [got[(i, rank)] for i in range(len(params))]


@dataclass(frozen=True)
class _RowExchange:
    """One all-to-all of row blocks: block (i, r) is rank r's rows of matrix i."""
    rows: list  # rows[i][r]
    cols: list  # cols[i]
    dtype: torch.dtype
    device: torch.device
    pg: object

    def size(self, block) -> int:
        i, r = block
        return self.rows[i][r] * self.cols[i]

    def __call__(self, blocks: dict, send_plan: list, recv_plan: list) -> dict:
        """Send blocks[b] for b in send_plan[dst] to each dst; return {b: tensor} for b in recv_plan[src]."""
        flat = [blocks[b].to(self.dtype).reshape(-1) for plan in send_plan for b in plan]
        outgoing = torch.cat(flat) if flat else torch.empty(0, dtype=self.dtype, device=self.device)
        recv_sizes = [sum(map(self.size, plan)) for plan in recv_plan]
        incoming = outgoing.new_empty(sum(recv_sizes))
        dist.all_to_all_single(incoming, outgoing, recv_sizes, [sum(map(self.size, plan)) for plan in send_plan],
                               group=self.pg)
        got, offset = {}, 0
        for b in (b for plan in recv_plan for b in plan):
            got[b] = incoming[offset:offset + self.size(b)].view(self.rows[b[0]][b[1]], self.cols[b[0]])
            offset += self.size(b)
        return got


def _rows_of(matrix, rows: list, rank: int):
    start = sum(rows[:rank])
    return matrix[start:start + rows[rank]]


def _mesh_group(param: DTensor):
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"Muon under FSDP expects parameters sharded along dim 0 on a 1-D mesh, got "
                         f"{param.placements} on a {param.device_mesh.ndim}-D mesh")
    return param.device_mesh.get_group()
