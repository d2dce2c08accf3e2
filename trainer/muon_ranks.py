"""Where Muon's orthogonalisation runs (trainer/optim.py's Muon computes O = NewtonSchulz(U) for
every block matrix's update U through `orthogonalise`):

- batched: every matrix taken wide (m <= n), so each layer's q/o, k/v and MLP matrices fall into
  three stacks, one batched iteration each;
- here, in one process, or split across ranks: matrix i of a stack of n is rank i // ceil(n / W)'s.
  Under DDP one all-gather then hands every rank every result, so the replicas stay bitwise equal;
  under FSDP2 one all-to-all brings each owner the rows of its matrices and a second returns every
  rank its rows;
- and NorMuon's per-row figures, which under FSDP need every rank's rows (every_rank_rows).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


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


def orthogonalise(params, updates, run, dtype, process_group) -> list:
    """O = run(U) for every parameter's update, each in the layout this rank holds it (whole, or
    its FSDP rows), computed in `dtype`. `run` orthogonalises one (k, m, n) stack."""
    stacks = stacks_of([tuple(p.shape) for p in params])
    if isinstance(params[0], DTensor):
        return _orthogonalise_fsdp(params, updates, stacks, run, dtype)
    if process_group is None or dist.get_world_size(process_group) == 1:
        return _orthogonalise_here(updates, stacks, run, dtype)
    return _orthogonalise_ddp(updates, stacks, run, dtype, process_group)


def every_rank_rows(params, figures) -> list:
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
