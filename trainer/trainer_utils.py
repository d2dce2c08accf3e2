"""The shared module of the training scripts, where MiniMind users look for it: distributed
setup, sampler sharding, checkpoint entry points, LR schedule, seeding and model
construction. The distributed plumbing lives in trainer/distributed.py, checkpointing in
trainer/checkpoint.py and the sampler in trainer/data.py; they are re-exported here.
Nothing in trainer/ imports this module back, so there is no cycle."""
import math
import random

import numpy as np
import torch

from common.errors import UserError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, count_parameters
from model.weights import WeightsError, build_model, load_weights, read_sidecar, resolve_config
from trainer.checkpoint import (
    lm_checkpoint, load_latest_checkpoint, restore_model_and_optimizer, save_checkpoint,
)
from trainer.data import ResumableDistributedSampler
from trainer.distributed import (
    DistEnv, Logger, all_reduce_sum, barrier, broadcast_from_main, cleanup_distributed, exit_peer_lost, fail,
    group_store, init_distributed_mode, is_main_process, peer_lost,
)


__all__ = [
    # distributed setup and helpers
    "DistEnv", "Logger", "all_reduce_sum", "barrier", "broadcast_from_main", "cleanup_distributed",
    "exit_peer_lost", "fail", "group_store", "init_distributed_mode", "is_main_process", "peer_lost",
    # sampler sharding
    "ResumableDistributedSampler",
    # checkpoints
    "lm_checkpoint", "load_latest_checkpoint", "restore_model_and_optimizer", "save_checkpoint",
    # defined here
    "UserError", "get_lr", "init_model", "model_config_from_args", "setup_seed",
]


# ---------------------------------------------------------------------------- schedule, seeds
def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def setup_seed(seed: int):
    """Seed every generator we use. Callers pass `base_seed + rank`, so ranks differ
    (dropout masks are then independent across data-parallel replicas)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------------------- model
def model_config_from_args(args, vocab_size: int) -> MiniMindConfig:
    """The model the flags describe, or the config stored beside --from_weight (x.pth -> x.json),
    which decides the shape flags not typed; typed ones must agree with it."""
    stored = read_sidecar(args.from_weight) if args.from_weight else None  # raises WeightsError, a UserError
    if stored is not None:
        config = resolve_config(stored, args.model_flags, f"--from_weight {args.from_weight}")
        config.flash_attn = True
        return config
    return MiniMindConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        vocab_size=vocab_size,
        use_moe=bool(args.use_moe),
        flash_attn=True,
    )


def init_model(config: MiniMindConfig, from_weight: str | None = None, device="cpu") -> MiniMindForCausalLM:
    """Build the model in fp32, optionally from `--from_weight`, and print its size."""
    if from_weight:
        try:
            state = load_weights(from_weight)  # untrusted: tensors only, never a full unpickle
        except WeightsError as exc:
            raise UserError(f"--from_weight {exc}") from None
        model = build_model(state, config, f"--from_weight {from_weight}").train()
        Logger(f"loaded weights from {from_weight}")
    else:
        model = MiniMindForCausalLM(config)
    total, active = count_parameters(model)
    if config.use_moe:
        Logger(f"model: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token")
    else:
        Logger(f"model: {total / 1e6:.2f}M parameters")
    return model.to(device)
