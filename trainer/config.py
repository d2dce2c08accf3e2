"""A run's configuration: one typed, frozen TrainConfig, built once from the command line.

Every flag is a field of one of the groups below, with its default and help beside it: the
parser, --help and docs/flags.md are made from these fields, so each default lives here and
nowhere else. A stage changes defaults through one table (train_full_sft.py's SFT_DEFAULTS).

    output   where files go, when to save and log, whether to resume    this launch's
    optim    the batch, the optimizer and its schedule                  the run's
    model    the model and its first weights                            the run's
    data     training and held-out data, validation                     the run's
    system   device, precision, parallelism, profiling                  this launch's
    chat     fine-tuning's conversation flags (train_full_sft.py only)  the run's

Nine flags may be `auto` (--dtype, --optimizer, --muon_ns_steps, --lr_schedule, --normuon,
--muon_lr, --learning_rate, --weight_decay, --doc_mask). They are decided once at start-up
(trainer/auto.py's resolve_auto, which marks the config `resolved`), each logged with its reason,
and the resolved config is stored whole in every checkpoint's record (trainer/checkpoint.py). The checks
(check_config) run on that final config: the one a resume merged and auto resolved, the one the
run trains with.

A resume merges the checkpoint's stored config under this command line's by one rule
(trainer/resume_config.py); FIXED below names the flags a checkpoint's state pins.
"""
import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.cli import OneLineArgumentParser, adam_betas, at_least, auto_or, flag, number_from, share, step_window
from common.errors import UserError
from dataset.demo_corpus import DEMO_CORPUS
from model.model_minimind import SHAPE_FIELDS
from model.shape_flags import flag_default, shape_problem
from trainer.auto import (ADAM_BETAS, ADAMW_LR_BESIDE_MUON, ADAMW_LR_BY_WIDTH, FEWER_NS_STEPS, MUON_LR_BY_WIDTH,
                          MUON_STEP_BOUND, WEIGHT_DECAY)
from trainer.optim import NS_STEPS
from trainer.schedule import SCHEDULES

REPO_ROOT = Path(__file__).resolve().parents[1]
# MiniMind's own flags (its trainer/train_pretrain.py): a public interface, same names, same meanings.
MINIMIND_FLAGS = ("save_dir", "save_weight", "epochs", "batch_size", "learning_rate", "device", "dtype",
                  "num_workers", "accumulation_steps", "grad_clip", "log_interval", "save_interval", "hidden_size",
                  "num_hidden_layers", "max_seq_len", "use_moe", "data_path", "from_weight", "from_resume",
                  "use_wandb", "wandb_project", "use_compile")
LAUNCH_GROUPS = ("output", "system")


# ---------------------------------------------------------------------------- the groups
def lr_text(lr: float) -> str:
    """An lr as a user types it: 0.02, 3e-3, 3.75e-4."""
    if lr >= 0.01:
        return f"{lr:g}"
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def by_width(points) -> str:
    """An lr table of trainer/auto.py as --help says it."""
    measured = ", ".join(f"hidden {width} ({lr_text(lr)})" for width, lr in points)
    return f"{measured}, a straight line between, the nearest beyond (docs/time-to-quality.md)"


def betas_text(betas) -> str:
    """A pair of AdamW betas as --adam_betas takes it: 0.9,0.999."""
    return ",".join(f"{beta:g}" for beta in betas)


@dataclass(frozen=True)
class OutputConfig:
    save_dir: str = flag(str(REPO_ROOT / "out"), "weights (.pth, with its config .json) and metrics go here")
    save_weight: str = flag("pretrain", "file name prefix of weights and checkpoints")
    checkpoint_dir: str = flag(str(REPO_ROOT / "checkpoints"), "resume checkpoints go here")
    save_interval: int = flag(100, "save weights + resume checkpoint every N steps", check=at_least(1))
    save_every_minutes: float = flag(0.0, "also save when this many minutes passed since the last save, on rank "
                                     "0's clock (0: off)", check=number_from(0, "minutes between saves, 0 for off"))
    keep_last: int = flag(3, "resume checkpoints to keep", check=at_least(1))
    from_resume: int = flag(0, "1: continue from the latest checkpoint", choices=(0, 1))
    log_interval: int = flag(10, "log every N optimizer steps", check=at_least(1))
    use_wandb: bool = flag(False, "log to Weights & Biases (offline without a key)")
    wandb_project: str = flag("MiniMind-Pretrain", "the wandb project")


@dataclass(frozen=True)
class OptimConfig:
    epochs: int = flag(1, "passes over the training data", check=at_least(1))
    max_steps: int = flag(0, "stop after N optimizer steps; the LR schedule spans them (0: run all epochs)",
                          check=at_least(0))
    batch_size: int = flag(32, "micro-batch per process", check=at_least(1))
    accumulation_steps: int = flag(1, "micro-batches per optimizer step", check=at_least(1))
    global_batch_size: int = flag(0, "samples per optimizer step over all processes; derives --accumulation_steps "
                                  "(0: off)", check=at_least(0))
    learning_rate: float | Literal["auto"] = flag(
        "auto", f"AdamW's peak lr (MiniMind: 5e-4); auto: {lr_text(ADAMW_LR_BESIDE_MUON)} beside Muon (the "
        f"embedding and norms), and with AdamW on everything by width, the lr measured best at "
        f"{by_width(ADAMW_LR_BY_WIDTH)}", type=auto_or(float),
        check=number_from(0, "the peak learning rate, e.g. 5e-4", strict=True))
    warmup_steps: int = flag(10, "linear warmup to each group's peak, then --lr_schedule (MiniMind: 0)",
                             check=at_least(0))
    lr_schedule: str = flag("auto", "after the warmup: cosine decay to the floor at the last step (MiniMind's); wsd: "
                            "the peak until the last --cooldown_frac of the run, then linear to the floor; auto: wsd",
                            choices=("auto", *SCHEDULES))
    cooldown_frac: float = flag(0.2, "wsd: the share of the run its linear cooldown to the floor takes",
                                check=share("the share of the run the wsd cooldown takes, e.g. 0.2"))
    min_lr_frac: float = flag(0.1, "the floor of either schedule, a share of each group's peak lr",
                              check=share("the lr floor as a share of each peak, e.g. 0.1"))
    optimizer: str = flag("auto", "muon: Muon on the blocks' 2-D weights, AdamW on the embedding (= tied head) and "
                          "norms; adamw: AdamW on everything; auto: muon where its Newton-Schulz runs in a native "
                          f"precision and, at --muon_ns_steps, adds at most {MUON_STEP_BOUND - 1:.0%}% to a step's "
                          "FLOPs (docs/performance.md), or where --normuon 1 asks for it, else adamw",
                          choices=("auto", "adamw", "muon"))
    muon_lr: float | Literal["auto"] = flag(
        "auto", f"Muon's peak lr; auto: by width, the lr measured best at {by_width(MUON_LR_BY_WIDTH)}",
        type=auto_or(float),
        check=number_from(0, "Muon's peak learning rate, e.g. 0.01", strict=True))
    normuon: int | Literal["auto"] = flag("auto", "1: NorMuon, each row of Muon's update divided by the root of its running mean "
                        "square, then rescaled to the update's norm; auto: 1 with Muon", type=auto_or(int),
                        choices=("auto", 0, 1))
    muon_ns_steps: int | Literal["auto"] = flag(
        "auto", f"Newton-Schulz iterations in each Muon step; auto: {NS_STEPS} (torch.optim.Muon's), or "
        f"{FEWER_NS_STEPS} where {NS_STEPS} would add more than {MUON_STEP_BOUND - 1:.0%}% to a step's FLOPs "
        "(docs/performance.md)",
        type=auto_or(int), check=number_from(1, "Newton-Schulz iterations per Muon step, e.g. 5"))
    param_groups: str = flag("split", "split: no weight decay on norms and other 1-D params; single: MiniMind's "
                             "one AdamW group", choices=("split", "single"))
    grad_clip: float = flag(1.0, "clip the global gradient norm (0 or less: off); the log's grad_norm is that "
                            "norm before clipping, averaged over the log window",
                            check=lambda v: None if not math.isnan(v) else "must be a number (0 or less turns "
                                                                             "clipping off), got nan")
    weight_decay: float | Literal["auto"] = flag(
        "auto", f"decoupled weight decay (AdamW and Muon); auto: {WEIGHT_DECAY['muon']} with Muon, "
        f"{WEIGHT_DECAY['adamw']} (torch's and MiniMind's) for AdamW on everything (docs/time-to-quality.md)",
        type=auto_or(float), check=number_from(0, "AdamW's decoupled weight decay, e.g. 0.01"))
    adam_betas: tuple | Literal["auto"] = flag(
        "auto", f"AdamW's beta1,beta2; auto: {betas_text(ADAM_BETAS['muon'])} (torch's and MiniMind's) beside Muon, "
        f"{betas_text(ADAM_BETAS['adamw'])} for AdamW on everything (docs/time-to-quality.md)", type=auto_or(adam_betas))
    seed: int = flag(42, "initial weights, sample order, per-rank generators",
                     check=lambda v: at_least(0)(v) or (None if v < 2 ** 31 else
                                                        f"must be below 2**31 (numpy seeds are 32-bit), got {v}"))
    max_bad_steps: int = flag(5, "abort after N consecutive non-finite steps", check=at_least(1))


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = flag(flag_default("hidden_size"), "model width (8 heads of an even width: a multiple of 16)",
                            check=lambda v: (why := shape_problem({"hidden_size": v}))
                            and f"makes no model ({why}): pass a multiple of 16")
    num_hidden_layers: int = flag(flag_default("num_hidden_layers"), "blocks", check=at_least(1))
    max_seq_len: int = flag(340, "tokens per sample (a padded line or a packed window)", check=at_least(2))
    vocab_size: int = flag(flag_default("vocab_size"), "the model's embedding rows (>= the tokenizer's)", check=at_least(1))
    use_moe: int = flag(0, "1: mixture-of-experts feed-forward blocks", choices=(0, 1))
    from_weight: str = flag("none", "initial weights: a name, as MiniMind's (pretrain: {save_dir}/pretrain_{hidden}"
                            "[_moe].pth), a .pth, .safetensors or resume checkpoint, or none (from scratch)")
    zero_init_outputs: int = flag(1, "1: a fresh model's block output projections (o_proj, down_proj) start at 0, "
                                  "each block as the identity (docs/time-to-quality.md); 0: MiniMind's init",
                                  choices=(0, 1))
    tokenizer_path: str = flag(str(REPO_ROOT / "model"), "folder with tokenizer.json")


@dataclass(frozen=True)
class DataConfig:
    data_path: str = flag(str(DEMO_CORPUS), ".jsonl (padded) or .bin (packed, see prepare_data.py); or a "
                          "directory, manifest.json or quoted glob of .bin shards or .jsonl files")
    doc_mask: int | Literal["auto"] = flag(
        "auto", "packed data: 1 attends within each document only (FlexAttention on A100/H100/B200, a dense mask "
        "elsewhere), 0 across the whole window; auto: 1 with Muon, 0 for AdamW on everything (docs/time-to-quality.md)",
        type=auto_or(int), choices=("auto", 0, 1))
    val_data_path: str | None = flag(None, "held-out .jsonl or .bin", type=str)
    val_fraction: float = flag(0.01, "hold-out share of the training data (its tail) when no --val_data_path",
                               check=share("the held-out share", one=False))
    eval_interval: int = flag(100, "validate every N steps (0: only at the end)", check=at_least(0))
    eval_batches: int = flag(8, "micro-batches per process per validation", check=at_least(1))
    eval_task: str | None = flag(None, "a multiple-choice task (.jsonl, as dataset/tasks/ holds) scored with "
                                 "validation: acc and acc_norm in the log, the metrics file and wandb", type=str)


@dataclass(frozen=True)
class SystemConfig:
    device: str | None = flag(None, "cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when CUDA is present, else "
                              "cpu; under a launcher every rank takes cuda:LOCAL_RANK)", type=str)
    dtype: str = flag("auto", "autocast dtype; auto: bf16 on CUDA (fp16 on GPUs without bf16), bf16 on CPUs with "
                      "amx_bf16/avx512_bf16, else float32", choices=("auto", "float32", "bfloat16", "float16"))
    num_workers: int = flag(2, "DataLoader worker processes per rank", check=at_least(0))
    use_compile: int = flag(0, "1: torch.compile the model", choices=(0, 1))
    parallel: str = flag("ddp", "fsdp: FSDP2 shards parameters, gradients and optimizer state across ranks",
                         choices=("ddp", "fsdp"))
    grad_checkpointing: int = flag(0, "1: recompute each block in the backward pass (less memory, slower steps)",
                                   choices=(0, 1))
    dist_timeout: float = flag(600.0, "seconds a collective may wait for a peer, and the trainer for a DataLoader "
                               "worker's batch", check=number_from(0, "seconds a collective may wait, e.g. 600",
                                                                   strict=True))
    profile_steps: tuple | None = flag(None, "A:B: a torch.profiler trace of rank 0's optimizer steps A to B in "
                                       "{save_dir}/profile/ (Perfetto, TensorBoard)", type=step_window)
    memory_snapshot: int = flag(0, "1: a CUDA memory snapshot of the --profile_steps window (else steps 1:3) and "
                                "on out-of-memory, in {save_dir}/profile/ (pytorch.org/memory_viz)", choices=(0, 1))
    # The legacy launcher passes --local-rank=N (older torch: --local_rank); LOCAL_RANK wins.
    local_rank: int | None = flag(None, argparse.SUPPRESS, type=int)


@dataclass(frozen=True)
class ChatConfig:
    add_system_ratio: float = flag(0.0, "the share of conversations without a system turn (and without tools) that "
                                   "get one of dataset/sft_dataset.py's system prompts, drawn per sample from --seed "
                                   "(MiniMind: 0.2)", check=share("a share of conversations"))
    empty_think_ratio: float = flag(1.0, "the share of samples whose assistant turns keep an empty <think> block, "
                                    "as the chat template renders them (MiniMind: 0.2)",
                                    check=share("a share of samples"))


GROUPS = {"output": OutputConfig, "optim": OptimConfig, "model": ModelConfig, "data": DataConfig,
          "system": SystemConfig, "chat": ChatConfig}
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
# The model's shape fields (model/model_minimind.py) that the trainer takes as flags; the others
# follow from them.
MODEL_SHAPE_FLAGS = tuple(name for name in SHAPE_FIELDS if GROUP_OF.get(name) == "model")
# What a resume may not change: the shapes the checkpoint's tensors and schedule were made for.
FIXED = (*MODEL_SHAPE_FLAGS, "optimizer", "param_groups", "lr_schedule", "normuon")


@dataclass(frozen=True)
class TrainConfig:
    output: OutputConfig = field(default_factory=OutputConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    # Set by trainer/auto.py's resolve_auto: no flag is "auto" any more, and the checks have the
    # values the run trains with. The parser's config is unresolved.
    resolved: bool = False

    @classmethod
    def of(cls, **values) -> "TrainConfig":
        """The defaults, with `values` given by flag name (learning_rate=1e-3, ...)."""
        return cls().replace(**values)

    def replace(self, **values) -> "TrainConfig":
        """A copy with the flags named in `values` changed."""
        by_group = {}
        for name, value in values.items():
            if name not in GROUP_OF:
                raise KeyError(f"no flag --{name}")
            by_group.setdefault(GROUP_OF[name], {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **v) for g, v in by_group.items()})

    def flags(self) -> dict:
        """Every flag's value, by name."""
        return {name: getattr(getattr(self, group), name) for name, group in GROUP_OF.items()}

    def record(self) -> dict:
        """The config as the checkpoint's JSON record stores it: {group: {flag: value}}."""
        return {group: dataclasses.asdict(getattr(self, group)) for group in GROUPS}


# ---------------------------------------------------------------------------- the command line
PRETRAIN_GROUPS = ("output", "optim", "model", "data", "system")
PRETRAIN_DESCRIPTION = "MiniMind pre-training (single process, torchrun DDP/FSDP, multi-node)"


def stage_fields(stage=None):
    """(group, field, default) of every flag a stage takes (trainer/loop.py's Stage: its groups
    and defaults; None: pre-training's), in --help's order."""
    defaults = stage.defaults if stage else {}
    for group in stage.groups if stage else PRETRAIN_GROUPS:
        for f in dataclasses.fields(GROUPS[group]):
            yield group, f, defaults.get(f.name, f.default)


def build_parser(stage=None) -> argparse.ArgumentParser:
    """Every flag of the stage, from the config's fields. None has an argparse default, so
    that what a command line typed is told from what it left to the defaults."""
    parser = OneLineArgumentParser(description=stage.description if stage else PRETRAIN_DESCRIPTION,
                                   argument_default=argparse.SUPPRESS)
    groups = {}
    for group, f, default in stage_fields(stage):
        arguments = groups.get(group) or groups.setdefault(group, parser.add_argument_group(group))
        meta = f.metadata
        help_text = stage.help.get(f.name, meta["help"]) if stage else meta["help"]
        names = [f"--{f.name}"] if f.name != "local_rank" else ["--local-rank", "--local_rank"]
        if f.type is bool:
            arguments.add_argument(*names, action="store_true", help=help_text)
            continue
        if help_text != argparse.SUPPRESS and default is not None:
            help_text += f" (default: {shown(default)})"
        arguments.add_argument(*names, dest=f.name, help=help_text, choices=meta["choices"],
                               type=meta["type"] or type(default))
    return parser


def shown(value) -> str:
    """A default as a user types it."""
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace(str(REPO_ROOT), "<repo>")


def parse_config(argv=None, stage=None) -> tuple[TrainConfig, frozenset]:
    """(the config, the names of the flags the command line typed). A typed value out of its
    flag's range stops here, before any process group or file exists."""
    typed = vars(build_parser(stage).parse_args(argv))
    defaults = {f.name: default for _, f, default in stage_fields(stage)}
    cfg = TrainConfig.of(**{**defaults, **typed})
    check_ranges(cfg)
    return cfg, frozenset(typed)


def check_ranges(cfg: TrainConfig):
    """Each flag's own range (its field's `check`), in one line."""
    for group in GROUPS:
        for f in dataclasses.fields(GROUPS[group]):
            problem = f.metadata["check"] and f.metadata["check"](getattr(getattr(cfg, group), f.name))
            if problem:
                raise UserError(f"--{f.name} {problem}")


def check_config(cfg: TrainConfig, cuda: bool = False):
    """The config a run trains with, whole: each flag's range, and the combinations no run can
    train with; one line, before any work. `cfg` is final: what a resume merged from its
    checkpoint and auto resolved (trainer/resume_config.py's settle_config), so a rule sees a stored value
    beside a typed one. cuda: whether the run's device (trainer/device.py) is a GPU."""
    if not cfg.resolved:
        raise ValueError("check_config takes the resolved config (trainer/auto.py's resolve_auto)")
    check_ranges(cfg)
    name = cfg.output.save_weight
    if not name or set(name) & {"/", "\\"} or name in (".", ".."):
        raise UserError(f"--save_weight {name!r} is a file name prefix, not a path: pass a plain name such as "
                        f"pretrain (folders go in --save_dir)")
    if cfg.optim.optimizer == "muon" and cfg.optim.param_groups == "single":
        raise UserError("--param_groups single is MiniMind's AdamW-on-everything recipe; with --optimizer muon drop "
                        "it (or pass --optimizer adamw)")
    if cfg.optim.optimizer == "adamw" and cfg.optim.normuon == 1:
        raise UserError("--normuon 1 changes Muon's update, and --optimizer adamw trains without Muon: drop it (or "
                        "pass --optimizer muon or auto)")
    if cfg.system.dtype == "float16" and not cuda:
        raise UserError("--dtype float16 needs CUDA (its GradScaler is CUDA-only); on CPU use --dtype bfloat16 or "
                        "float32")
    if cfg.system.memory_snapshot and not cuda:
        raise UserError("--memory_snapshot 1 records CUDA allocations, and this run is on the CPU: drop it (the log's "
                        "mem column is the CPU's peak RSS)")
    if cfg.system.parallel == "fsdp" and cfg.system.dtype == "float16":
        raise UserError("--parallel fsdp trains in bfloat16 or float32 (no sharded GradScaler here); pass --dtype "
                        "bfloat16")
    augments = cfg.chat.add_system_ratio > 0 or cfg.chat.empty_think_ratio < 1
    if augments and Path(cfg.data.data_path).suffix == ".bin":
        raise UserError(f"--data_path {cfg.data.data_path}: a packed file holds its conversations rendered once, as "
                        f"the template renders them; --add_system_ratio and --empty_think_ratio draw when a .jsonl "
                        f"line is read: pass the .jsonl, or drop them")


# ---------------------------------------------------------------------------- where a run's files go
def run_prefix(save_weight: str, hidden_size: int, use_moe) -> str:
    """The name of a run's files: `{save_weight}_{hidden}[_moe]` + .pth, .json, _metrics.jsonl, _resume..."""
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}"


def weights_path(save_dir, prefix: str) -> str:
    """The half-precision inference weights, MiniMind's format (the model config beside them as .json)."""
    return os.path.join(save_dir, f"{prefix}.pth")


def metrics_path(save_dir, prefix: str) -> str:
    """One JSON row per log step and per validation."""
    return os.path.join(save_dir, f"{prefix}_metrics.jsonl")


def default_weight_path(save_dir, hidden_size=None, use_moe=None, save_weight="pretrain") -> Path:
    """Where a default training run with these shape flags left its weights (what the scripts
    read when given no --weight_path)."""
    return Path(weights_path(save_dir, run_prefix(save_weight, hidden_size or flag_default("hidden_size"), use_moe)))
