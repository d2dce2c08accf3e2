"""Muon for the matrices inside the transformer blocks, batched by shape and split across ranks.

The update of each matrix W with gradient G is torch.optim.Muon's:

    B <- lerp(B, G, 1 - momentum)                  momentum buffer (an average of gradients)
    U <- lerp(G, B, momentum)                      Nesterov's look-ahead
    O <- NewtonSchulz5(U / |U|)                    close to the nearest orthogonal matrix
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

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
    its rows of each result.
  * In the run's precision: `ns_dtype` is bf16 where the run trains under bf16 autocast,
    fp32 where it trains in fp32 (torch.optim.Muon always uses bf16). fp32 keeps a run
    the same run at any world size to float noise, and is fast on CPUs without bf16.
  * Compiled on CUDA (`compile_ns`): the batched iteration only, which sees no learning
    rate, so nothing recompiles as the schedule moves.

Its param groups and state ("momentum_buffer") are torch.optim.Muon's, key for key, so a
checkpoint written with either optimizer resumes with this one.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# The quintic Newton-Schulz coefficients of Keller Jordan's Muon (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = EPS):
    """Orthogonalise each matrix of a (k, m, n) stack with m <= n: scaled to Frobenius norm 1,
    then `steps` quintic iterations X <- aX + (bA + cA^2)X with A = XX^T."""
    a, b, c = coefficients
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def newton_schulz_flops(shapes, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of one orthogonalisation of matrices of these shapes, as newton_schulz runs
    them (wide, m <= n): per step X X^T (2m^2n), A A (2m^3) and B X (2m^2n)."""
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
    bring their own group, their mesh's.
    """

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn=None, *, ns_dtype: torch.dtype = torch.float32, process_group=None,
                 compile_ns: bool = False):
        if adjust_lr_fn not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: only torch.optim.Muon's default (None) is implemented")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype
        self.process_group = process_group
        self._orthogonalise_stack = torch.compile(newton_schulz, dynamic=False) if compile_ns else newton_schulz

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
        local = [_local(p) for p in params]
        grads = [_local(p.grad) for p in params]
        buffers = []
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buffers.append(_local(self.state[p]["momentum_buffer"]))
        momentum = group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        orthogonal = self._orthogonalise(params, updates, group)
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(local, 1 - lr * group["weight_decay"])
        for p, weight, update in zip(params, local, orthogonal):
            weight.add_(update, alpha=-adjusted_lr(lr, p.shape))

    # ------------------------------------------------------------------ where O is computed
    def _orthogonalise(self, params, updates, group) -> list:
        """O for every parameter, each in the layout this rank holds it (whole, or its FSDP rows)."""
        stacks = stacks_of([tuple(p.shape) for p in params])
        run = lambda x: self._orthogonalise_stack(x, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
        sharded = isinstance(params[0], DTensor)
        if sharded:
            return _orthogonalise_fsdp(params, updates, stacks, run, self.ns_dtype)
        pg = self.process_group
        if pg is None or dist.get_world_size(pg) == 1:
            return _orthogonalise_here(updates, stacks, run, self.ns_dtype)
        return _orthogonalise_ddp(updates, stacks, run, self.ns_dtype, pg)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


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
