"""Command-line flags of train_pretrain.py, parsed into one namespace and checked
up front, so a bad flag costs a one-line message instead of a failed run."""
import argparse
from pathlib import Path

import torch

from trainer.cli import OneLineArgumentParser
from trainer.trainer_utils import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO_ROOT / "dataset" / "demo_pretrain.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description="MiniMind pre-training (single process, torchrun DDP/FSDP, multi-node)")
    out = p.add_argument_group("output")
    out.add_argument("--save_dir", default=str(REPO_ROOT / "out"), help="weights (.pth) and metrics go here")
    out.add_argument("--save_weight", default="pretrain", help="file name prefix of weights and checkpoints")
    out.add_argument("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="resume checkpoints go here")
    out.add_argument("--save_interval", type=int, default=100, help="save weights + resume checkpoint every N steps")
    out.add_argument("--save_every_minutes", type=float, default=0,
                     help="also save when this many minutes passed since the last save (0: off; "
                          "checked every --log_interval steps)")
    out.add_argument("--keep_last", type=int, default=3, help="resume checkpoints to keep")
    out.add_argument("--log_interval", type=int, default=10, help="log every N optimizer steps")
    out.add_argument("--use_wandb", action="store_true")
    out.add_argument("--wandb_project", default="MiniMind-Pretrain")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=int, default=1)
    opt.add_argument("--max_steps", type=int, default=0, help="stop after N optimizer steps (0: run all epochs)")
    opt.add_argument("--batch_size", type=int, default=32, help="micro-batch per process")
    opt.add_argument("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument("--global_batch_size", type=int, default=0,
                     help="samples per optimizer step over all processes; derives --accumulation_steps (0: off)")
    opt.add_argument("--learning_rate", type=float, default=5e-4)
    opt.add_argument("--warmup_steps", type=int, default=0)
    opt.add_argument("--grad_clip", type=float, default=1.0)
    opt.add_argument("--weight_decay", type=float, default=0.01)
    opt.add_argument("--seed", type=int, default=42)
    opt.add_argument("--max_bad_steps", type=int, default=5, help="abort after N consecutive non-finite steps")

    mdl = p.add_argument_group("model")
    mdl.add_argument("--hidden_size", type=int, default=512)
    mdl.add_argument("--num_hidden_layers", type=int, default=8)
    mdl.add_argument("--max_seq_len", type=int, default=340)
    mdl.add_argument("--vocab_size", type=int, default=6400)
    mdl.add_argument("--use_moe", type=int, default=0, choices=[0, 1])
    mdl.add_argument("--from_weight", default=None, help="initial weights (.pth or resume checkpoint)")
    mdl.add_argument("--from_resume", type=int, default=0, choices=[0, 1], help="1: continue from the latest checkpoint")
    mdl.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"))

    data = p.add_argument_group("data")
    data.add_argument("--data_path", default=str(DEMO_CORPUS), help=".jsonl (padded) or .bin (packed, see prepare_data.py)")
    data.add_argument("--num_workers", type=int, default=2)
    data.add_argument("--doc_mask", type=int, default=0, choices=[0, 1], help="packed data: attend within documents only")
    data.add_argument("--val_data_path", default=None, help="held-out .jsonl or .bin")
    data.add_argument("--val_fraction", type=float, default=0.01, help="hold-out share of the training data when no --val_data_path")
    data.add_argument("--eval_interval", type=int, default=100, help="validate every N steps (0: only at the end)")
    data.add_argument("--eval_batches", type=int, default=8, help="micro-batches per process per validation")

    sys_ = p.add_argument_group("system")
    sys_.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is present, else cpu")
    sys_.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU)")
    sys_.add_argument("--use_compile", type=int, default=0, choices=[0, 1])
    sys_.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"])
    sys_.add_argument("--grad_checkpointing", type=int, default=0, choices=[0, 1])
    sys_.add_argument("--dist_timeout", type=float, default=600, help="seconds a collective may wait for a peer")
    sys_.add_argument("--peak_tflops", type=float, default=0, help="device peak for MFU (default: looked up by GPU name)")
    # The legacy launcher passes --local-rank=N (older torch: --local_rank); LOCAL_RANK env wins.
    sys_.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def check_args(args, cuda_available: bool):
    """Reject impossible settings before any work is done."""
    for flag in ("batch_size", "accumulation_steps", "epochs", "max_seq_len", "hidden_size", "num_hidden_layers"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    for flag in ("save_interval", "log_interval", "keep_last", "max_bad_steps"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.max_steps < 0 or args.global_batch_size < 0 or args.warmup_steps < 0:
        raise UserError("--max_steps, --global_batch_size and --warmup_steps must not be negative")
    if args.save_every_minutes < 0:
        raise UserError(f"--save_every_minutes must not be negative, got {args.save_every_minutes}")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if args.hidden_size % 8:
        raise UserError(f"--hidden_size must be a multiple of 8 (8 attention heads), got {args.hidden_size}")
    if args.dtype == "float16" and not cuda_available:
        raise UserError("--dtype float16 needs CUDA (its GradScaler is CUDA-only); on CPU use --dtype bfloat16 or float32")
    if args.parallel == "fsdp" and args.dtype == "float16":
        raise UserError("--parallel fsdp trains in bfloat16 or float32 (no sharded GradScaler here); "
                        "pass --dtype bfloat16")
    if args.parallel == "fsdp" and args.use_compile:
        raise UserError("--use_compile 1 is not supported with --parallel fsdp yet; drop one of them")


def resolve_dtype(args, device: str) -> torch.dtype:
    name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    args.dtype = name
    return getattr(torch, name)
