"""How the model is spread over processes: DDP (a full replica per rank) or FSDP2
(parameters, gradients and optimizer state sharded across ranks)."""
import torch
from torch.nn.parallel import DistributedDataParallel


def wrap_model(model, args, env):
    """Returns the module the loop calls. `model` itself stays the plain
    MiniMindForCausalLM whose state_dict the checkpoints hold."""
    model.model.gradient_checkpointing = bool(args.grad_checkpointing)
    if args.use_compile:
        model = torch.compile(model)
    if not env.distributed:
        return model
    if args.parallel == "fsdp":
        from trainer.fsdp import shard_model

        return shard_model(model, args, env)
    # device_ids only on CUDA: with gloo on CPU there is no device to pin.
    # The only buffers are the RoPE tables, identical on every rank; re-broadcasting
    # them before every forward would cost a copy of each per step.
    device_ids = [env.local_rank] if env.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
