"""The shared module of the training scripts, where MiniMind users look for its entry points:
get_lr, Logger, is_main_process, init_distributed_mode, setup_seed, init_model and
lm_checkpoint. Their names are MiniMind's, but three of their signatures and return values are
not: init_distributed_mode returns the run's environment (a DistEnv), not the local rank;
init_model takes a built config and a weights path and returns the model alone, not (model,
tokenizer); lm_checkpoint takes a folder and a prefix, not MiniMind's config and weight name.
get_lr, Logger, is_main_process and setup_seed take MiniMind's calls (get_lr adds an optional
warmup and floor). A MiniMind script that calls the other three needs those calls changed.

As in MiniMind, the seeding and the model's construction (its config, its first weights, its
initialisation) are defined here, and the loop builds its model with them; the rest are
defined where their concept lives (the cosine schedule in trainer/schedule.py, the process
group in trainer/distributed.py, checkpoints in trainer/checkpoint.py) and exported here by
name, the very functions the trainer uses (tests/test_trainer_utils.py fails otherwise). Only
trainer/loop.py imports this module, so there is no cycle."""
import os
import random
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError, WeightsError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, count_parameters
from model.shape_flags import resolve_config
from model.weights import build_model, load_weights, read_sidecar
from trainer.checkpoint import CheckpointManager
from trainer.config import MODEL_SHAPE_FLAGS, run_prefix, weights_path
from trainer.distributed import Logger, init_distributed_mode, is_main_process
from trainer.schedule import cosine_lr as get_lr  # MiniMind's name for it
from trainer.train_state import ModelState

__all__ = ["get_lr", "Logger", "is_main_process", "init_distributed_mode", "setup_seed", "init_model",
           "initial_weights", "model_config", "zero_output_projections", "lm_checkpoint"]

WEIGHT_SUFFIXES = (".pth", ".safetensors")


def initial_weights(cfg, must_exist: bool = True) -> str | None:
    """The file --from_weight names, or None to start from scratch. A path is taken as it is;
    a plain name is MiniMind's: the weights a stage of that --save_weight saved in --save_dir
    for this shape (pretrain -> {save_dir}/pretrain_{hidden}[_moe].pth), which must exist
    (`must_exist` False: None where the file is not there)."""
    value = cfg.model.from_weight
    if value is None or value.lower() == "none":
        return None
    if Path(value).suffix in WEIGHT_SUFFIXES or os.sep in value or Path(value).exists():
        return value if must_exist or Path(value).exists() else None
    path = weights_path(cfg.output.save_dir, run_prefix(value, cfg.model.hidden_size, cfg.model.use_moe))
    if not must_exist and not Path(path).is_file():
        return None
    if not Path(path).is_file():
        raise UserError(f"--from_weight {value}: no {path} (a name means {{save_dir}}/{value}_{{hidden}}[_moe].pth, "
                        f"as MiniMind names it): train that stage first, pass the weights file itself, or pass "
                        f"--from_weight none to start from scratch")
    return path


def setup_seed(seed: int):
    """Seed every generator we use. Callers pass `base_seed + rank`, so ranks differ
    (dropout masks are then independent across data-parallel replicas)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def model_config(cfg, typed=frozenset(MODEL_SHAPE_FLAGS), need_weights: bool = True) -> MiniMindConfig:
    """The model the config describes, or the config stored beside the weights --from_weight
    names (x.pth -> x.json), which decides the shape flags not typed (`typed`: the flags the
    command line gave); typed ones must agree with it. `need_weights` False (a resume, whose
    checkpoint holds the weights and its record the shape): a --from_weight no longer there is passed over."""
    from_weight = initial_weights(cfg, must_exist=need_weights)
    stored = read_sidecar(from_weight) if from_weight else None  # raises WeightsError, a UserError
    if stored is not None:
        given = {name: getattr(cfg.model, name) if name in typed else None for name in MODEL_SHAPE_FLAGS}
        config = resolve_config(stored, given, f"--from_weight {from_weight}")
        config.flash_attn = True
        return config
    return MiniMindConfig(hidden_size=cfg.model.hidden_size, num_hidden_layers=cfg.model.num_hidden_layers,
                          vocab_size=cfg.model.vocab_size, use_moe=bool(cfg.model.use_moe), flash_attn=True)


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


OUTPUT_PROJECTIONS = ("o_proj", "down_proj")  # what each block adds to the residual stream goes through these


@torch.no_grad()
def zero_output_projections(model) -> int:
    """Zero every block's output projections (attention's o_proj; the MLP's down_proj, every
    expert's under MoE), so each block starts as the identity on the residual stream and its
    share grows from 0 (modded-nanogpt's and nanochat's init). The gradients of the weights
    before them start at 0 too; the output projections' own do not. The model's architecture
    and files do not change: --zero_init_outputs 1 calls this for a fresh run. Returns how
    many it zeroed."""
    zeroed = [m for name, m in model.named_modules() if name.rpartition(".")[2] in OUTPUT_PROJECTIONS]
    for module in zeroed:
        module.weight.zero_()
    Logger(f"zero init: the {len(zeroed)} output projections ({', '.join(OUTPUT_PROJECTIONS)}) start at 0")
    return len(zeroed)


class _PlainState:
    """A dict of the caller's (step counters and the like) as a checkpoint part."""

    def __init__(self, state: dict):
        self.state = state
        self.keys = tuple(state)  # a checkpoint lacking one of them cannot restore this dict
        self.record_keys = tuple(k for k in ("global_step", "tokens_seen", "world_size") if k in state)

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, saved: dict):
        self.state.update({k: saved[k] for k in self.state})


def lm_checkpoint(checkpoint_dir, prefix, model=None, optimizer=None, state=None, model_config=None,
                  keep_last=3, sharded=False):
    """MiniMind's single entry point, through the trainer's CheckpointManager: with `state` (a dict
    holding at least global_step, tokens_seen and world_size) it saves a resume checkpoint of the
    model, optimizer and state, and returns its path; without, it returns the newest verified
    checkpoint of `prefix` as a dict (the weights in rank 0's copy), or None."""
    if model_config is None:
        model_config = model.config.to_dict() if model is not None else (state or {}).get("model_config", {})
    parts = {"state": _PlainState({k: v for k, v in (state or {}).items() if k != "model_config"})}
    manager = CheckpointManager(checkpoint_dir, prefix, model_config, ModelState(model, optimizer), parts,
                                keep_last, sharded)
    if state is not None:
        return manager.save(state["global_step"])
    return manager.latest()
