"""How the model is spread over processes: DDP (a full replica per rank) or FSDP2
(parameters, gradients and optimizer state sharded across ranks)."""
import inspect
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


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
