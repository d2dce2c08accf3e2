"""How the processes of a run work together: joining the process group (under every
launcher), rank-0-only printing, the collectives (no-ops in a single process), how the model
is spread over the ranks (DDP: a full replica each; FSDP2: parameters, gradients and optimizer
state sharded), and exiting every rank promptly on a user error or a lost peer."""
import gc
import inspect
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from common.errors import say_error, tell_torchrun
from trainer.device import launcher_local_rank, resolve_device


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def init_distributed_mode(device: torch.device | str | None = None, timeout_s: float = 1800,
                          local_rank_flag: int | None = None) -> DistEnv:
    """Join the process group if a launcher started us (torchrun and torch.distributed.launch
    export RANK and WORLD_SIZE), on `device` (trainer/device.py's resolve_device decides it;
    a string or None is resolved here). NCCL for CUDA processes, gloo for CPU ones.
    `local_rank_flag`: --local-rank, which the legacy launcher passes instead of LOCAL_RANK."""
    if not isinstance(device, torch.device):
        device = resolve_device(device, local_rank_flag)
    if device.type == "cuda":
        # The process's current device, before NCCL starts: contexts, compiled kernels and memory stats land there.
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return DistEnv(device=device)
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = restart_safe_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return DistEnv(rank=dist.get_rank(), local_rank=launcher_local_rank(local_rank_flag),
                   world_size=dist.get_world_size(), device=device)


def restart_safe_store(timeout: timedelta):
    """A store of this worker group's own under torchrun's elastic agent (None elsewhere).

    The agent hands its workers one TCPStore for the whole job (static rendezvous, and
    c10d rendezvous unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). A re-formed group
    would find the dead group's gloo/NCCL addresses there under the same keys and hang
    in init_process_group. No key prefix fixes this under c10d: the restart count is
    each agent's own (a node that joins late starts at 0, and a membership change does
    not count), so two members of one group can disagree. Instead rank 0 serves a
    fresh store on a free port and posts its address in the agent's store; the others
    take the posted address once it answers with the nonce posted beside it (a stale
    one is left over from a dead rank 0: by the time a new group starts every agent
    has stopped its old workers, so nothing answers there).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    agent_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return group_store(agent_store, host, int(os.environ["RANK"]), timeout)


def group_store(agent_store, host: str, rank: int, timeout: timedelta):
    """Rank 0 serves a new store and posts its port in `agent_store`; the others connect."""
    key = "minimind/group_store"
    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = f"{os.getpid()}-{time.time_ns()}"
        store.set("minimind/nonce", nonce)
        agent_store.set(key, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = agent_store.get(key).decode().split()
        if _port_open(host, int(port)):  # probe first: a failed TCPStore connect logs pages
            try:
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
                if store.get("minimind/nonce").decode() == nonce:
                    store.set_timeout(timeout)
                    return store
            except RuntimeError:  # DistError too: the port is taken by something else now
                pass
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rank {rank}: no store from rank 0 of this group within {timeout}")
        time.sleep(0.2)


def _port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_from_main(obj):
    """Rank 0's value of `obj` on every rank, so all ranks take the same decision."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Collectives:
    """The few collectives the checkpoint manager and its parts use, over torch.distributed's
    default group (each is a no-op in a single process). Its unit tests pass a stand-in that
    plays one rank of a job in a thread."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def barrier(self):
        barrier()

    def broadcast(self, obj):
        return broadcast_from_main(obj)

    def agree(self, problem: str | None) -> str | None:
        """The first rank's problem (None: none), on every rank, so all stop or go on together."""
        return next((p for p in self.all_gather(problem) if p), None)

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not dist.is_initialized():
            return [obj]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered


TORCH_COLLECTIVES = Collectives()


def cleanup_distributed(clean: bool = True):
    """Leave the process group without tripping gloo at exit.

    gloo can abort the process (SIGABRT, "terminate called without an active
    exception") when a DDP model is still alive at destroy time, so the caller drops
    its references first; we collect them and let every rank arrive before tearing
    down. After a failure a peer may be gone, so no barrier then.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def peer_lost(exc: BaseException) -> bool:
    """Did a collective fail because another process of the group died or hung?
    NCCL and the stores raise DistError; gloo raises a plain RuntimeError naming itself."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def exit_peer_lost(exc: BaseException, resumes: bool):
    """Say in one line that a peer is gone and what happens next, then exit non-zero:
    one line instead of a gloo/NCCL stack trace on every surviving rank. The teardown
    is the one a failed rank does (no barrier), which also gives the rank that failed
    the time to exit first, so torchrun names it as the root cause. Every rank gives the
    line to torchrun's report (the ranks that keep quiet too: which of them exits first is
    chance), and only after the teardown: a peer that failed gave its own failure earlier
    and stays the root cause; a peer that hangs fails only when torchrun stops it, so this
    line is the root cause then."""
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip()).split("\n")[0].split(". ")[0][:160]
    restarts_left = (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
                     - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if restarts_left <= 0:
        then = "no torchrun restart is left (--max-restarts); relaunch with --from_resume 1"
    elif resumes:
        then = "torchrun restarts the group with the processes left and it resumes from the last checkpoint"
    else:
        then = "torchrun restarts the group with the processes left, from step 0 (pass --from_resume 1 to resume)"
    line = f"error: lost a peer process ({reason}); {then}"
    if is_main_process() or os.environ.get("LOCAL_RANK") == "0":
        print(line, file=sys.stderr, flush=True)
    cleanup_distributed(clean=False)
    tell_torchrun(line)
    sys.exit(1)


def teardown_after_crash(exc: BaseException):
    """The teardown after an exception that no one turned into a line (the caller re-raises
    it), its traceback first given to torchrun's report, as torch's @record would: the peers
    notice this rank is gone only at the teardown, so this failure is stamped before their
    "lost a peer" lines and stays the root cause."""
    if isinstance(exc, Exception):
        try:
            ErrorHandler().record_exception(exc)
        except OSError:
            pass  # the traceback is on stderr anyway
    cleanup_distributed(clean=False)


def Logger(*content, **kwargs):
    """print() on rank 0 only."""
    if is_main_process():
        print(*content, **kwargs, flush=True)


def fail(message: str, code: int = 2, this_rank_only: bool = False):
    """Report a problem in one line and exit non-zero.

    A problem every rank meets (bad flags, bad data): rank 0 prints it, and so does the
    first process of every other node, since a problem can be local to a node (a file
    missing there). The rest wait a moment before exiting: torchrun tears the whole
    group down when any rank exits, and rank 0 must get its line out first; its failure,
    the first, is the root cause torchrun's report names, with the line.
    `this_rank_only`: a problem of this rank alone, which then says it itself.
    """
    # Before the process group exists (flag checks come first) the launcher's RANK says who speaks.
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0 or os.environ.get("LOCAL_RANK") == "0" or this_rank_only:
        say_error(f"error: {message}")
    else:
        time.sleep(1.0)
    cleanup_distributed(clean=False)
    sys.exit(code)


# ---------------------------------------------------------------------------- the model over the ranks

def wrap_model(model, env, parallel: str = "ddp", dtype: str = "float32", use_compile: bool = False,
               grad_checkpointing: bool = False):
    """Returns the module the loop calls. With DDP `model` stays the plain
    MiniMindForCausalLM; FSDP shards it in place (its parameters become DTensors).
    `dtype`: the run's resolved autocast dtype (never "auto")."""
    model.model.gradient_checkpointing = grad_checkpointing
    if parallel == "fsdp" and env.distributed:
        return shard_model(model, env, dtype, use_compile)
    if replica_group(env, parallel) is None:
        # One replica has nothing to all-reduce: DDP would only add its hooks and bucket copies.
        return torch.compile(model) if use_compile else model
    # device_ids only on CUDA: with gloo on CPU there is no device to pin. Gradients live in
    # DDP's all-reduce buckets (views), so no copy into and out of the buckets each step.
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    net = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync())
    # Compiled after wrapping, dynamo's DDP optimizer cuts the graph at DDP's bucket
    # boundaries, so each bucket's all-reduce overlaps the rest of the backward; a model
    # compiled first would run its whole backward as one node, and all-reduce only after it.
    return torch.compile(net) if use_compile else net


def replica_group(env, parallel: str):
    """The process group of DDP's replicas, which hold the same averaged gradients (and so can
    share Muon's work); None for one process, one rank, or FSDP."""
    if parallel == "fsdp" or not env.distributed or env.world_size == 1:
        return None
    return dist.group.WORLD


def no_buffer_sync(ddp_class=DistributedDataParallel) -> dict:
    """DDP's argument that stops the buffer broadcast before every forward. The only
    buffers are the RoPE tables, identical on every rank; re-broadcasting them would cost
    a copy of each per step. torch 2.13 renamed broadcast_buffers to forward_sync_buffers
    (the old name also skips buffers in the initial sync, harmless for identical tables);
    older torch, such as a GPU image's, only knows the old name."""
    if "forward_sync_buffers" in inspect.signature(ddp_class).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def shard_model(model, env, dtype: str, use_compile: bool = False):
    """FSDP2: one shard group per transformer block, and the root for the rest
    (the tied embedding / lm_head, the final norm). A block's full weights exist
    only while it computes, so memory per rank falls with the world size.
    With --use_compile each block is compiled on its own (in place, so parameter
    names do not change), between the all-gathers that FSDP runs around it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if env.device.type == "cuda" and dtype == "bfloat16":
        # Compute in bf16, keep fp32 master weights and reduce gradients in fp32.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        if use_compile:
            block.compile()
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


@contextmanager
def gradient_sync(net, enabled: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on micro-batches
    that are not the last of an accumulation window."""
    net = getattr(net, "_orig_mod", net)  # the module inside torch.compile's wrapper
    if enabled:
        yield
    elif isinstance(net, DistributedDataParallel):
        with net.no_sync():
            yield
    elif hasattr(net, "set_requires_gradient_sync"):
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dict(model) -> dict:
    """The whole model's weights as CPU tensors, gathered from the shards under FSDP.
    Every rank must call it; rank 0 is the one that writes them."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def weights_finite(model) -> bool:
    """True when no rank holds a NaN or Inf weight (each rank checks what it holds).

    One fused pass and one host read: the largest |w| of every tensor (a max, so a
    finite weight never overflows it; NaN and Inf propagate), summed over ranks on the
    device, then read once. A read per parameter would stall a GPU a hundred times."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    local = [p for p in local if p.numel()]  # an FSDP shard can be empty
    device = next(model.parameters()).device  # NCCL cannot reduce CPU tensors
    norms = torch._foreach_norm(local, float("inf")) if local else [torch.zeros((), device=device)]
    peak = torch.stack([n.float() for n in norms]).max()
    bad = (~torch.isfinite(peak)).float()
    if dist.is_initialized():
        dist.all_reduce(bad)
    return bad.item() == 0


def local_state_mib(model, optimizer) -> tuple[float, float]:
    """(weights, optimizer state) in MiB held by this rank: the part FSDP divides by the world size."""
    def mib(tensors):
        return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors) / 2**20

    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return mib(model.parameters()), mib(states)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its FSDP shard (a DTensor's local tensor), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_local_scalar(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value
