"""Muon for the matrices inside the transformer blocks, batched by shape and split across ranks.

The update of each matrix W with gradient G is torch.optim.Muon's:

    B <- lerp(B, G, 1 - momentum)                  momentum buffer (an average of gradients)
    U <- lerp(G, B, momentum)                      Nesterov's look-ahead
    O <- NewtonSchulz5(U / |U|)                    close to the nearest orthogonal matrix
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

Three options change it, each off here (the update is then exactly the above; the trainer's
--normuon is on for a new run, docs/time-to-quality.md):
  * ns_method "polar_express": Polar Express's five coefficient tuples in Newton-Schulz in
    place of the one quintic (trainer/newton_schulz.py).
  * normuon: NorMuon (Li et al., 2025). O's rows (output neurons) still differ in size;
    each is divided by the root of its running mean square, v <- lerp(v, mean(O_row^2),
    1 - beta2), kept per row in the state ("row_second_moment"), and the result is rescaled
    to O's Frobenius norm: the step keeps Muon's size, its rows share it more evenly.
  * cautious_wd: the decay only where O and W agree in sign (trainer/weight_decay.py).
They are options of the optimizer, not keys of its param groups: the groups stay
torch.optim.Muon's key for key, and a resumed run takes them from its flags, as its lrs.

What this file adds is where and how O is computed:
  * Batched. Newton-Schulz runs on a matrix with rows <= cols (a tall one is taken
    transposed, and its result transposed back), so q and o, k and v, and gate, up and
    down projections of every layer fall into three stacks, each orthogonalised by one
    batched iteration instead of dozens of small ones.
  * Split across ranks. Matrix i of a stack of n belongs to rank i // ceil(n / W); only
    its owner orthogonalises it. Under DDP every rank holds the whole averaged gradient,
    so the owners' results are all-gathered and every rank applies every update: the
    weights stay bitwise identical on all ranks. Under FSDP2 a rank holds rows of every
    matrix; Newton-Schulz of a shard alone is not the shard of Newton-Schulz, so one
    all-to-all brings each owner the rows of its matrices, and a second sends every rank
    its rows of each result. NorMuon then works on the rows each rank holds (its v is
    sharded as W is); only its two Frobenius norms need every rank's rows (_every_rank_rows).
  * In the run's precision: `ns_dtype` is bf16 where the run trains under bf16 autocast,
    fp32 where it trains in fp32 (torch.optim.Muon always uses bf16). fp32 keeps a run
    the same run at any world size to float noise, and is fast on CPUs without bf16.
  * Compiled on CUDA (`compile_update`): the batched iteration and NorMuon's arithmetic, which
    see no learning rate, so nothing recompiles as the schedule moves.

Its param groups and state ("momentum_buffer") are torch.optim.Muon's, key for key, so a
checkpoint written with either optimizer resumes with this one; NorMuon adds its v to the state,
and starts it at zero where a checkpoint has none.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from trainer.newton_schulz import EPS, NS_COEFFICIENTS, NS_STEPS, iteration_plan, newton_schulz
from trainer.parallel import local_part
from trainer.weight_decay import decay_

# Added to NorMuon's v, a mean square of O's entries (about 1 / max(rows, cols)): it only keeps
# the root of an all-zero row's v finite.
NORMUON_EPS = 1e-10


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

    def owner_of(self, position: int, world_size: int) -> int:
        return position // self.per_rank(world_size)

    def per_rank(self, world_size: int) -> int:
        return -(-len(self.members) // world_size)

    def owned(self, rank: int, world_size: int) -> range:
        """Positions in the stack that `rank` orthogonalises."""
        k = self.per_rank(world_size)
        return range(min(rank * k, len(self.members)), min((rank + 1) * k, len(self.members)))


def stacks_of(shapes) -> list[Stack]:
    """Group matrices by their shape taken wide (rows <= cols), in order of first appearance."""
    groups = {}
    for i, (rows, cols) in enumerate(shapes):
        key = (min(rows, cols), max(rows, cols))
        groups.setdefault(key, []).append((i, rows > cols))
    return [Stack(key, tuple(i for i, _ in members), tuple(t for _, t in members)) for key, members in groups.items()]


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, batched, split over `process_group` and in `ns_dtype`.

    process_group: the ranks whose gradients DDP has averaged, which then share the
    Newton-Schulz work (None: this process does all of it). FSDP2 parameters (DTensors)
    bring their own group, their mesh's. ns_method, normuon, normuon_beta2, cautious_wd:
    the options of the module docstring.
    """

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn=None, *, ns_dtype: torch.dtype = torch.float32, process_group=None,
                 compile_update: bool = False, ns_method: str = "quintic", normuon: bool = False,
                 normuon_beta2: float = 0.95, cautious_wd: bool = False):
        if adjust_lr_fn not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: only torch.optim.Muon's default (None) is implemented")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        iteration_plan(ns_method)  # a bad name fails here, not at the first step
        self.ns_dtype = ns_dtype
        self.process_group = process_group
        self.ns_method, self.cautious_wd = ns_method, cautious_wd
        self.normuon, self.normuon_beta2 = normuon, normuon_beta2
        # Compiled on CUDA, where launching each of their many small ops one by one would cost
        # more than the arithmetic: NorMuon is about 20 ops per matrix.
        maybe_compile = (lambda fn: torch.compile(fn, dynamic=False)) if compile_update else (lambda fn: fn)
        self._orthogonalise_stack = maybe_compile(newton_schulz)
        if normuon:
            self._normuon_row_stats, self._normuon_rescale = maybe_compile(row_stats), maybe_compile(rescale)

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
        local = [local_part(p) for p in params]
        grads = [local_part(p.grad) for p in params]
        buffers = []
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buffers.append(local_part(self.state[p]["momentum_buffer"]))
        momentum = group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        orthogonal = self._orthogonalise(params, updates, group)
        if self.normuon:
            moments = [self._row_moment(p) for p in params]
            figures, inv_rms = self._normuon_row_stats(orthogonal, moments, self.normuon_beta2)
            orthogonal = self._normuon_rescale(orthogonal, inv_rms, _every_rank_rows(params, figures))
        lr = group["lr"]
        decay_(local, lr * group["weight_decay"], orthogonal if self.cautious_wd else None)
        for p, weight, update in zip(params, local, orthogonal):
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

    # ------------------------------------------------------------------ where O is computed
    def _orthogonalise(self, params, updates, group) -> list:
        """O for every parameter, each in the layout this rank holds it (whole, or its FSDP rows)."""
        stacks = stacks_of([tuple(p.shape) for p in params])
        plan, safety = iteration_plan(self.ns_method, group["ns_coefficients"], group["ns_steps"])
        run = lambda x: self._orthogonalise_stack(x, plan, safety, group["eps"])  # noqa: E731
        sharded = isinstance(params[0], DTensor)
        if sharded:
            return _orthogonalise_fsdp(params, updates, stacks, run, self.ns_dtype)
        pg = self.process_group
        if pg is None or dist.get_world_size(pg) == 1:
            return _orthogonalise_here(updates, stacks, run, self.ns_dtype)
        return _orthogonalise_ddp(updates, stacks, run, self.ns_dtype, pg)


# ------------------------------------------------------------------ NorMuon
# NorMuon's rescaling of each O (whole, or the rows this rank holds), in two halves so that the
# norms between them can take in every rank's rows under FSDP:
#   row_stats: v <- lerp(v, mean(O_row^2), 1 - beta2) in place, and each row's figures;
#   rescale:   O_row / sqrt(v + eps), scaled back to O's Frobenius norm.
def row_stats(updates, moments, beta2: float):
    """Updates each matrix's per-row v in `moments`; returns, per matrix, its rows' (|O_row|^2,
    |O_row / sqrt(v + eps)|^2) as a (rows, 2) tensor, and 1 / sqrt(v + eps)."""
    row_squares = [u.float().square().contiguous().sum(dim=-1) for u in updates]
    for v, squares, u in zip(moments, row_squares, updates):
        v.lerp_(squares / u.shape[-1], 1 - beta2)
    inv_rms = [(v + NORMUON_EPS).rsqrt() for v in moments]
    figures = [torch.stack([sq, sq * s.square()], dim=1) for sq, s in zip(row_squares, inv_rms)]
    return figures, inv_rms


def rescale(updates, inv_rms, figures) -> list:
    """Each O's rows times its inv_rms, times |O| / |O / sqrt(v + eps)|, summed from `figures` over
    all the matrix's rows (the rows held here, or under FSDP every rank's: _every_rank_rows)."""
    norms = [f.sum(dim=0) for f in figures]
    # An all-zero O (a zero gradient) has both norms 0: the clamp keeps its update 0, not NaN.
    scales = [s * (before / after.clamp(min=1e-30)).sqrt() for s, (before, after) in zip(inv_rms, norms)]
    return [u * scale.unsqueeze(-1) for u, scale in zip(updates, scales)]


def _every_rank_rows(params, figures) -> list:
    """Each matrix's per-row `figures` for all its rows, in the same bits on every layout: under
    FSDP each rank sets its rows among zeros and one all-reduce fills in every rank's (adding
    zeros changes no bit)."""
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
    """Each rank orthogonalises its share of every stack; one all-gather hands every rank all of them.
    Every rank then applies the very same bits to its replica, so the replicas stay bitwise equal."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    mine = [run(_stack(updates, s, s.owned(rank, world), dtype, pad_to=s.per_rank(world))) for s in stacks]
    send = torch.cat([m.reshape(-1) for m in mine])
    gathered = send.new_empty(world * send.numel())
    _all_gather(gathered, send, pg)
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
    """FSDP2: every rank holds rows of every matrix (Shard(0)). all-to-all #1 brings each owner
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

    # 1. my rows of each matrix go to its owner; all rows of the matrices I own come to me
    got = exchange({(i, rank): updates[i] for i in range(len(params))},
                   send_plan=[[(i, rank) for i in owned_by[dst]] for dst in range(world)],
                   recv_plan=[[(i, src) for i in mine] for src in range(world)])
    whole = {i: torch.cat([got[(i, src)] for src in range(world)]) for i in mine}

    # 2. orthogonalise them, a stack at a time
    result = {}
    for stack in stacks:
        positions = list(stack.owned(rank, world))
        if positions:
            batch = run(_stack(whole, stack, positions, dtype))
            for b, j in enumerate(positions):
                result[stack.members[j]] = _oriented(batch[b], stack.transposed[j])

    # 3. every rank's rows of each result go back to it
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


def _all_gather(output, tensor, pg):
    # torch 2.13 renamed all_gather_into_tensor; a GPU image may have an older torch.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=pg)
