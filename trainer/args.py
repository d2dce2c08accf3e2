"""Command-line flags of train_pretrain.py, parsed into one namespace and checked
up front, so a bad flag costs a one-line message instead of a failed run."""
import argparse
import math
from pathlib import Path

from common.errors import UserError
from dataset.demo_corpus import DEMO_CORPUS
from model.shape_flags import FLAG_DEFAULTS
from trainer.cli import OneLineArgumentParser
from trainer.optim import check_optim_args
from trainer.profiling import step_window

REPO_ROOT = Path(__file__).resolve().parents[1]
# MiniMind's own flags (its trainer/train_pretrain.py): a public interface, same names, same meanings.
MINIMIND_FLAGS = ("save_dir", "save_weight", "epochs", "batch_size", "learning_rate", "device", "dtype",
                  "num_workers", "accumulation_steps", "grad_clip", "log_interval", "save_interval", "hidden_size",
                  "num_hidden_layers", "max_seq_len", "use_moe", "data_path", "from_weight", "from_resume",
                  "use_wandb", "wandb_project", "use_compile")


def build_parser(stage=None) -> argparse.ArgumentParser:
    """Every flag, with its help: docs/flags.md is generated from it (scripts/flags_table.py).
    `stage` (trainer/loop.py's Stage; None: pre-training) adds its own flags and defaults."""
    p = OneLineArgumentParser(description=stage.description if stage else "MiniMind pre-training")
    for add_group in (_output_flags, _optimisation_flags, _model_flags, _data_flags, _system_flags):
        add_group(p)
    if stage is not None:
        if stage.add_flags:
            stage.add_flags(p)
        p.set_defaults(**stage.defaults)
        for action in p._actions:  # a flag that means something else to the stage says so in --help
            action.help = stage.help.get(action.dest, action.help)
    return p


def _output_flags(p):
    out = p.add_argument_group("output")
    out.add_argument("--save_dir", default=str(REPO_ROOT / "out"),
                     help="weights (.pth, with its config .json) and metrics go here")
    out.add_argument("--save_weight", default="pretrain", help="file name prefix of weights and checkpoints")
    out.add_argument("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="resume checkpoints go here")
    out.add_argument("--save_interval", type=int, default=100, help="save weights + resume checkpoint every N steps")
    out.add_argument("--save_every_minutes", type=float, default=0,
                     help="also save when this many minutes passed since the last save, on rank 0's clock (0: off)")
    out.add_argument("--keep_last", type=int, default=3, help="resume checkpoints to keep")
    out.add_argument("--log_interval", type=int, default=10, help="log every N optimizer steps")
    out.add_argument("--use_wandb", action="store_true", help="log to Weights & Biases (offline without a key)")
    out.add_argument("--wandb_project", default="MiniMind-Pretrain", help="the wandb project")


def _optimisation_flags(p):
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=int, default=1, help="passes over the training data")
    opt.add_argument("--max_steps", type=int, default=0,
                     help="stop after N optimizer steps; the LR schedule spans them (0: run all epochs)")
    opt.add_argument("--batch_size", type=int, default=32, help="micro-batch per process")
    opt.add_argument("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument("--global_batch_size", type=int, default=0,
                     help="samples per optimizer step over all processes; derives --accumulation_steps (0: off)")
    opt.add_argument("--learning_rate", type=float, default=3e-3, help="AdamW's peak lr (MiniMind: 5e-4)")
    opt.add_argument("--warmup_steps", type=int, default=10,
                     help="linear warmup to each group's peak, then --lr_schedule (MiniMind: 0)")
    opt.add_argument("--lr_schedule", default="auto", choices=["auto", "cosine", "wsd"],
                     help="after the warmup: cosine decay to the floor at the last step (MiniMind's); wsd: "
                          "warmup-stable-decay, the peak until the last --cooldown_frac of the run, then linear "
                          "to the floor; auto: wsd for a new run (docs/time-to-quality.md), a resume keeps its "
                          "checkpoint's")
    opt.add_argument("--cooldown_frac", type=float, default=0.2,
                     help="wsd: the share of the run its linear cooldown to the floor takes")
    opt.add_argument("--min_lr_frac", type=float, default=0.1,
                     help="the floor of either schedule, a share of each group's peak lr")
    opt.add_argument("--optimizer", default="auto", choices=["auto", "adamw", "muon"],
                     help="muon: Muon (trainer/muon.py) on the blocks' 2-D weights, AdamW on the embedding (= tied "
                          "head) and norms; adamw: AdamW on everything; auto: muon where its Newton-Schulz runs in a "
                          "native precision (not fp16, not emulated bf16) and adds at most 75%% to a step's FLOPs, "
                          "where Muon still reached a loss sooner than AdamW (docs/performance.md), else adamw; "
                          "said in one line at start-up")
    opt.add_argument("--muon_lr", type=auto_or(float), default="auto",
                     help="Muon's peak lr (its schedule has the same shape); auto: for a new run 0.01 up to "
                          "hidden 256, 0.02 from 512, linear between (docs/time-to-quality.md); a resume keeps "
                          "its checkpoint's")
    opt.add_argument("--muon_momentum", type=float, default=0.95, help="Muon's momentum (Nesterov)")
    opt.add_argument("--muon_momentum_warmup", type=int, default=0,
                     help="raise Muon's momentum linearly from 0.85 to --muon_momentum over the first N steps "
                          "(0: off)")
    opt.add_argument("--muon_ns", default="quintic", choices=["quintic", "polar_express"],
                     help="Muon's Newton-Schulz coefficients: quintic (Keller Jordan's, one tuple five times) or "
                          "polar_express (Amsel et al., 2025: one tuple per iteration, closer to orthogonal; "
                          "trainer/newton_schulz.py)")
    opt.add_argument("--normuon", type=auto_or(int), default="auto", choices=["auto", 0, 1],
                     help="1: NorMuon, each row of Muon's update divided by the root of its running mean square, "
                          "then rescaled to the update's norm (trainer/muon.py); auto: 1 for a new run with Muon "
                          "(docs/time-to-quality.md), a resume keeps its checkpoint's")
    opt.add_argument("--normuon_beta2", type=float, default=0.95,
                     help="NorMuon: the decay of each row's running mean square")
    opt.add_argument("--cautious_wd", default="none", choices=["none", "muon", "adamw", "both"],
                     help="cautious weight decay in these optimizers: decay only where the update and the weight "
                          "agree in sign (trainer/weight_decay.py; AdamW then runs unfused: trainer/adamw.py)")
    opt.add_argument("--lr_ref_width", type=int, default=0,
                     help="scale the AdamW groups' peak lrs by (hidden_size / W) ** -0.5, as nanochat does at W "
                          "768 (the defaults were tuned at 256; 0: off)")
    opt.add_argument("--param_groups", default="split", choices=["split", "single"],
                     help="split: no weight decay on norms and other 1-D params; single: MiniMind's one AdamW group")
    opt.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm (0 or less: off)")
    opt.add_argument("--weight_decay", type=float, default=0.01, help="decoupled weight decay (AdamW and Muon)")
    opt.add_argument("--adam_betas", type=adam_betas, default=(0.9, 0.95),
                     help="AdamW's beta1,beta2 (MiniMind, torch's default: 0.9,0.999)")
    opt.add_argument("--seed", type=int, default=42, help="initial weights, sample order, per-rank generators")
    opt.add_argument("--max_bad_steps", type=int, default=5, help="abort after N consecutive non-finite steps")


def _model_flags(p):
    mdl = p.add_argument_group("model")
    mdl.add_argument("--hidden_size", type=int, default=FLAG_DEFAULTS["hidden_size"], help="model width (8 heads)")
    mdl.add_argument("--num_hidden_layers", type=int, default=FLAG_DEFAULTS["num_hidden_layers"], help="blocks")
    mdl.add_argument("--max_seq_len", type=int, default=340, help="tokens per sample (a padded line or a packed window)")
    mdl.add_argument("--vocab_size", type=int, default=6400, help="the model's embedding rows (>= the tokenizer's)")
    mdl.add_argument("--use_moe", type=int, default=0, choices=[0, 1], help="1: mixture-of-experts feed-forward blocks")
    mdl.add_argument("--from_weight", default="none",
                     help="initial weights: a name, as MiniMind's (pretrain: {save_dir}/pretrain_{hidden}[_moe].pth), "
                          "a .pth, .safetensors or resume checkpoint, or none (from scratch)")
    mdl.add_argument("--from_resume", type=int, default=0, choices=[0, 1], help="1: continue from the latest checkpoint")
    mdl.add_argument("--zero_init_outputs", type=int, default=1, choices=[0, 1],
                     help="1: a fresh model's block output projections (o_proj, down_proj) start at 0, so each block "
                          "starts as the identity (not with --from_weight; the model and its files are unchanged; "
                          "docs/time-to-quality.md); 0: MiniMind's initialisation")
    mdl.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"), help="folder with tokenizer.json")


def _data_flags(p):
    data = p.add_argument_group("data")
    data.add_argument("--data_path", default=str(DEMO_CORPUS), help=".jsonl (padded) or .bin (packed, see "
                      "prepare_data.py); or a directory, manifest.json or quoted glob of .bin shards or .jsonl files")
    data.add_argument("--num_workers", type=int, default=2, help="DataLoader worker processes per rank")
    data.add_argument("--doc_mask", type=int, default=0, choices=[0, 1],
                      help="packed data: attend within documents only (FlexAttention on CUDA, a dense mask on CPU)")
    data.add_argument("--val_data_path", default=None, help="held-out .jsonl or .bin")
    data.add_argument("--val_fraction", type=float, default=0.01,
                      help="hold-out share of the training data (its tail) when no --val_data_path")
    data.add_argument("--eval_interval", type=int, default=100, help="validate every N steps (0: only at the end)")
    data.add_argument("--eval_batches", type=int, default=8, help="micro-batches per process per validation")
    data.add_argument("--eval_task", default=None,
                      help="a multiple-choice task (.jsonl, as dataset/tasks/ holds) scored with validation: "
                           "acc and acc_norm in the log, the metrics file and wandb")


def _system_flags(p):
    sys_ = p.add_argument_group("system")
    sys_.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when CUDA is "
                      "present, else cpu; under a launcher every rank takes cuda:LOCAL_RANK)")
    sys_.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="autocast dtype; auto: bf16 on CUDA (fp16 on GPUs without bf16), bf16 on CPUs "
                           "with amx_bf16/avx512_bf16, else float32")
    sys_.add_argument("--use_compile", type=int, default=0, choices=[0, 1], help="1: torch.compile the model")
    sys_.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"],
                      help="fsdp: FSDP2 shards parameters, gradients and optimizer state across ranks")
    sys_.add_argument("--grad_checkpointing", type=int, default=0, choices=[0, 1],
                      help="1: recompute each block in the backward pass (less memory, slower steps)")
    sys_.add_argument("--dist_timeout", type=float, default=600,
                      help="seconds a collective may wait for a peer, and the trainer for a DataLoader worker's batch")
    sys_.add_argument("--peak_tflops", type=float, default=0, help="device peak for MFU (default: looked up by GPU name)")
    sys_.add_argument("--profile_steps", type=step_window, default=None,
                      help="A:B: a torch.profiler trace of optimizer steps A to B in {save_dir}/profile/ "
                           "(Perfetto, TensorBoard)")
    sys_.add_argument("--profile_ranks", default="0", choices=["0", "all"], help="whose trace --profile_steps writes")
    sys_.add_argument("--memory_snapshot", type=int, default=0, choices=[0, 1],
                      help="1: a CUDA memory snapshot of the --profile_steps window (else steps 1:3) and on "
                           "out-of-memory, in {save_dir}/profile/ (pytorch.org/memory_viz)")
    # The legacy launcher passes --local-rank=N (older torch: --local_rank); LOCAL_RANK env wins.
    sys_.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)


def adam_betas(text: str) -> tuple[float, float]:
    """argparse type of --adam_betas: 'B1,B2' with 0 <= B1, B2 < 1."""
    try:
        betas = tuple(float(part) for part in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise argparse.ArgumentTypeError(f"expected two numbers in [0, 1) as B1,B2 (e.g. 0.9,0.95), got {text!r}")
    return betas


def auto_or(number):
    """argparse type of a flag that is "auto" or a number of type `number` (--normuon, --muon_lr)."""
    def parse(text: str):
        if text == "auto":
            return text
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
    return parse


# Model flags that the config stored beside --from_weight decides when they are not typed.
MODEL_FLAGS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size")


def parse_args(argv=None, stage=None):
    parser = build_parser(stage)
    args = parser.parse_args(argv)
    # Parsed once more without their defaults, to tell a typed --hidden_size 512 from the default:
    # model_flags maps each of MODEL_FLAGS to its typed value, or None.
    parser.set_defaults(**dict.fromkeys(MODEL_FLAGS))
    typed = parser.parse_args(argv)
    return argparse.Namespace(**vars(args), model_flags={name: getattr(typed, name) for name in MODEL_FLAGS})


# Integer flags and their smallest allowed value.
INT_MINIMUMS = {
    "batch_size": 1, "accumulation_steps": 1, "epochs": 1, "hidden_size": 1, "num_hidden_layers": 1,
    "max_seq_len": 2,  # room for BOS and EOS
    "save_interval": 1, "log_interval": 1, "keep_last": 1, "max_bad_steps": 1, "eval_batches": 1,
    "max_steps": 0, "global_batch_size": 0, "warmup_steps": 0, "eval_interval": 0, "num_workers": 0, "seed": 0,
    "muon_momentum_warmup": 0, "lr_ref_width": 0,
}
# Float flags: (lowest allowed, whether the lowest itself is allowed, what the value means).
FLOAT_RANGES = {
    "learning_rate": (0.0, False, "the peak learning rate, e.g. 5e-4"),
    "weight_decay": (0.0, True, "AdamW's decoupled weight decay, e.g. 0.01"),
    "dist_timeout": (0.0, False, "seconds a collective may wait, e.g. 600"),
    "peak_tflops": (0.0, True, "the device's peak TFLOP/s, 0 to look it up"),
    "save_every_minutes": (0.0, True, "minutes of training between saves, 0 for off"),
    "muon_lr": (0.0, False, "Muon's peak learning rate, e.g. 0.01"),
    "muon_momentum": (0.0, True, "Muon's momentum, e.g. 0.95"),
}
# Float flags that are shares: (whether 1 itself is allowed, what the value means).
FRACTIONS = {
    "normuon_beta2": (False, "NorMuon's decay of each row's mean square, e.g. 0.95"),
    "cooldown_frac": (True, "the share of the run the wsd cooldown takes, e.g. 0.2"),
    "min_lr_frac": (True, "the lr floor as a share of each peak, e.g. 0.1"),
}


def check_args(args, device):
    """Reject impossible settings before any work is done: flags and the resolved device only,
    no files or processes."""
    cuda_available = device.type == "cuda"
    for flag, lowest in INT_MINIMUMS.items():
        if getattr(args, flag) < lowest:
            raise UserError(f"--{flag} must be at least {lowest}, got {getattr(args, flag)}")
    if args.seed >= 2 ** 31:
        raise UserError(f"--seed must be below 2**31 (numpy seeds are 32-bit), got {args.seed}")
    for flag, (lowest, inclusive, meaning) in FLOAT_RANGES.items():
        value = getattr(args, flag)
        if value == "auto":  # --muon_lr: a number once the run is resolved (trainer/settings.py)
            continue
        if not (math.isfinite(value) and (value >= lowest if inclusive else value > lowest)):
            bound = f"{'at least' if inclusive else 'above'} {lowest:g}"
            raise UserError(f"--{flag} must be a finite number {bound} ({meaning}), got {value}")
    for flag, (one_allowed, meaning) in FRACTIONS.items():
        value = getattr(args, flag)
        if not (0 <= value < 1 or (one_allowed and value == 1)):
            raise UserError(f"--{flag} must be in [0, 1{']' if one_allowed else ')'} ({meaning}), got {value}")
    if math.isnan(args.grad_clip):
        raise UserError("--grad_clip must be a number (0 or less turns clipping off), got nan")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if args.hidden_size % 8:
        raise UserError(f"--hidden_size must be a multiple of 8 (8 attention heads), got {args.hidden_size}")
    if not args.save_weight or set(args.save_weight) & {"/", "\\"} or args.save_weight in (".", ".."):
        raise UserError(f"--save_weight {args.save_weight!r} is a file name prefix, not a path: "
                        f"pass a plain name such as pretrain (folders go in --save_dir)")
    if args.dtype == "float16" and not cuda_available:
        raise UserError("--dtype float16 needs CUDA (its GradScaler is CUDA-only); on CPU use --dtype bfloat16 or float32")
    if args.memory_snapshot and not cuda_available:
        raise UserError("--memory_snapshot 1 records CUDA allocations, and this run is on the CPU: drop it "
                        "(the log's mem column is the CPU's peak RSS)")
    if args.parallel == "fsdp" and args.dtype == "float16":
        raise UserError("--parallel fsdp trains in bfloat16 or float32 (no sharded GradScaler here); "
                        "pass --dtype bfloat16")
    check_optim_args(args)

