"""What the flags leave to the machine or to the checkpoint, decided once at start-up:
--dtype, --optimizer, --lr_schedule, --normuon and --muon_lr at auto become values, each with the
reason it is logged with, and the run uses these instead of the flags. The hardware facts
come in as arguments (resolve_*), or are read from this machine (detect_*), so the rules
are tested for every machine on any one."""
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from common.errors import UserError
from model.model_minimind import MiniMindForCausalLM, count_parameters
from trainer.device import cuda_has_native_bf16, native_bf16_cpu_flags, read_cpu_flags
from trainer.distributed import Logger
from trainer.metrics import flops_per_token
from trainer.newton_schulz import newton_schulz_flops
from trainer.optim import is_block_matrix


def resolve_dtype(flag: str, device_type: str, cpu_flags=frozenset(), cuda_bf16: bool = True,
                  sharded: bool = False) -> tuple[str, str]:
    """(dtype name, why) for --dtype `flag` on a device of `device_type` ("cpu" or "cuda").

    auto: bf16 on CUDA, fp16 (with a GradScaler) on GPUs without native bf16 -- but fp32
    under FSDP, which has no sharded GradScaler here; on CPU bf16 autocast only where the
    CPU has native bf16, since emulated bf16 is slower than fp32.
    """
    if flag != "auto":
        return flag, "--dtype"
    if device_type == "cuda":
        if cuda_bf16:
            return "bfloat16", "auto: the GPU has native bf16"
        if sharded:
            return "float32", "auto: the GPU lacks native bf16 and FSDP has no fp16 GradScaler here"
        return "float16", "auto: the GPU lacks native bf16 (fp16 with a GradScaler)"
    native = native_bf16_cpu_flags(cpu_flags)
    if native:
        return "bfloat16", f"auto: the CPU has {'/'.join(native)}"
    return "float32", "auto: the CPU lacks amx_bf16/avx512_bf16, where bf16 autocast is slower than fp32"


# --optimizer auto's criterion: the most a Muon step may cost, in AdamW steps. Muon reached MiniMind's
# final loss in 1/2.9 of AdamW's steps at 256 x 4 and in 1/2.2 to 1/2.7 at 512 x 8 (docs/performance.md),
# so a Muon step costing up to 2.2 AdamW steps still arrives sooner; the bound keeps a margin below
# that, since the saving shrank with the width and was not measured wider.
MUON_STEP_BOUND = 1.75


def resolve_optimizer(flag: str, device_type: str, dtype: str, cpu_flags=frozenset(),
                      param_groups: str = "split", muon_share: float = 0.0, resumed: str | None = None
                      ) -> tuple[str, str]:
    """(optimizer name, why) for --optimizer `flag`, once the run's dtype is known.

    auto: Muon where a Muon step costs at most MUON_STEP_BOUND (1.75) AdamW steps, the time to
    quality measured at 256 x 4 and 512 x 8 (Muon needs under half of AdamW's steps). That takes
    two things. Newton-Schulz must run in a precision the hardware does natively: fp32 runs
    on every CPU, bf16 runs on CPUs and GPUs with native bf16 (not fp16 runs, whose
    Newton-Schulz would be fp32, nor emulated bf16). And its work must stay within the bound:
    `muon_share`, its FLOPs over the forward and backward FLOPs of the same optimizer step
    (muon_flop_share), at most 0.75. Measured in docs/performance.md, section "Muon": on CPU
    the step-time ratio follows muon_share in fp32 and stays below it in bf16.

    resumed: the optimizer of the checkpoint the run resumes (None: a new run, or a checkpoint
    older than this record). A run keeps it, whatever its tokens per step are now: the
    optimizer state of one does not load into the other.
    """
    if resumed and flag not in ("auto", resumed):
        raise UserError(f"--optimizer {flag}: the checkpoint this run resumes trained with {resumed}, whose "
                        f"state does not load into {flag}; pass --optimizer {resumed} (or auto), or start anew")
    if resumed:
        return resumed, "auto: the optimizer of the checkpoint it resumes" if flag == "auto" else "--optimizer"
    if flag != "auto":
        return flag, "--optimizer"
    if param_groups == "single":
        return "adamw", "auto: --param_groups single is AdamW on everything"
    if dtype == "float16":
        return "adamw", ("auto: fp16 on a GPU without native bf16, where Muon's Newton-Schulz would run in fp32, "
                         "far below the fp16 rate of the rest of the step")
    if dtype == "bfloat16" and device_type == "cpu" and not native_bf16_cpu_flags(cpu_flags):
        return "adamw", ("auto: bf16 is emulated on this CPU, where Muon's bf16 Newton-Schulz made a step "
                         "about 6x an AdamW step")
    allowed = MUON_STEP_BOUND - 1
    if muon_share > allowed:
        return "adamw", (f"auto: Muon's Newton-Schulz would add {muon_share:.0%} to each step's FLOPs, over the "
                         f"{allowed:.0%} it may; more tokens per step (--batch_size, --accumulation_steps) lower "
                         f"it, --optimizer muon takes it anyway")
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    return "muon", (f"auto: Newton-Schulz in {precision}, native here, adds {muon_share:.0%} to each step's "
                    f"FLOPs, within the {allowed:.0%} it may")


# The recipe's flags under "auto", each resolved by resolve_recipe.
RECIPE_FLAGS = ("lr_schedule", "normuon", "muon_lr")
# What a checkpoint whose record does not name one of them trained with: the default then.
UNRECORDED = {"lr_schedule": "cosine", "normuon": 0, "muon_lr": 0.02}
# Those a resume may not change: the schedule's shape, the optimizer state's layout. A given Muon
# lr wins over the checkpoint's, as --learning_rate does: lowering it on a resume is a user's call.
FIXED_ON_RESUME = ("lr_schedule", "normuon")


def fresh_recipe(hidden_size: int) -> dict:
    """A new run's recipe under auto: what beat the older defaults over 3 seeds (docs/time-to-quality.md).
    Muon's lr follows the width: 0.01 ended lower than 0.02 at hidden 256 and higher at 512 (both with
    zero-initialised outputs), so 0.01 up to 256, 0.02 from 512, and a straight line between."""
    muon_lr = 0.02 * min(1.0, max(0.5, hidden_size / 512))
    return {"lr_schedule": "wsd", "normuon": 1, "muon_lr": round(muon_lr, 6)}


def resolve_recipe(name: str, flag, optimizer: str, resumed: dict | None = None, *, hidden_size: int) -> tuple:
    """(value, why) of one of RECIPE_FLAGS (`name`) at `flag`, once the optimizer and the model's
    width are known.

    auto: a new run's value from fresh_recipe; a resume keeps its checkpoint's (resumed: that
    checkpoint's record), so that a run trains on as it started, whatever this version's
    defaults are. An explicit value of FIXED_ON_RESUME that the checkpoint contradicts stops the
    run. NorMuon is Muon's: off under AdamW.
    """
    if name == "normuon" and optimizer != "muon":
        return 0, f"--optimizer {optimizer}: NorMuon is Muon's"
    fresh = fresh_recipe(hidden_size)[name]
    if name in FIXED_ON_RESUME and resumed and name in resumed and flag not in ("auto", resumed[name]):
        raise UserError(f"--{name} {flag}: the checkpoint this run resumes trained with --{name} {resumed[name]}; "
                        f"pass that (or auto), or start anew")
    if flag != "auto":
        was = f" (the checkpoint it resumes trained with {resumed[name]})" if resumed and name in resumed else ""
        return flag, f"--{name}{was}"
    if not resumed:
        return fresh, f"auto: a new run's default (hidden {hidden_size}), as docs/time-to-quality.md measured"
    if name in resumed:
        return resumed[name], "auto: the checkpoint's it resumes"
    return UNRECORDED[name], (f"auto: the checkpoint it resumes predates recording it, so its default then; "
                              f"pass --{name} {fresh} if the run started with that")


def muon_flop_share(config, tokens_per_step: int, seq_len: int) -> float:
    """Newton-Schulz FLOPs of one Muon step over the forward and backward FLOPs of the optimizer
    step (tokens_per_step tokens in all ranks' micro-batches). Muon's work is split across the
    ranks as the tokens are, so the share holds per rank too, up to rounding: a rank runs
    ceil(n / W) matrices of a stack of n. The model is built on the meta device: shapes only,
    no memory."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    shapes = [tuple(p.shape) for name, p in model.named_parameters() if is_block_matrix(name, p)]
    step_flops = flops_per_token(config, count_parameters(model)[1], seq_len) * tokens_per_step
    return newton_schulz_flops(shapes) / step_flops


def detect_dtype(flag: str, device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """resolve_dtype with this machine's facts."""
    on_cuda = device.type == "cuda"
    return resolve_dtype(flag, device.type, cpu_flags=frozenset() if on_cuda else read_cpu_flags(),
                         cuda_bf16=cuda_has_native_bf16(device) if on_cuda else False, sharded=sharded)


def detect_optimizer(flag: str, device: torch.device, dtype: str, param_groups: str = "split",
                     muon_share: float = 0.0, resumed: str | None = None) -> tuple[str, str]:
    """resolve_optimizer with this machine's facts."""
    cpu_flags = read_cpu_flags() if device.type == "cpu" else frozenset()
    return resolve_optimizer(flag, device.type, dtype, cpu_flags=cpu_flags, param_groups=param_groups,
                             muon_share=muon_share, resumed=resumed)


@dataclass(frozen=True)
class RunSettings:
    dtype: str  # float32 | bfloat16 | float16
    optimizer: str  # adamw | muon
    sharded: bool  # FSDP over several processes: sharded weights, optimizer state and checkpoints
    lr_schedule: str = "cosine"  # cosine | wsd
    normuon: int = 0  # 1: NorMuon (Muon only)
    muon_lr: float = 0.02  # Muon's peak lr

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def autocast(self, device: torch.device) -> AbstractContextManager:
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(device.type, dtype=self.torch_dtype)

    def as_flags(self, args, accumulation_steps: int) -> dict:
        """The flags with what the run resolved in place of auto and of the derived values
        (what wandb records): the dtype, the optimizer, its schedule, NorMuon and Muon's lr and, under
        --global_batch_size, the accumulation steps it implies."""
        return {**vars(args), **self.record, "dtype": self.dtype, "accumulation_steps": accumulation_steps}

    @property
    def record(self) -> dict:
        """What each checkpoint's record names, so that a resume under "auto" trains on as it started."""
        return {"optimizer": self.optimizer, "lr_schedule": self.lr_schedule, "normuon": self.normuon,
                "muon_lr": self.muon_lr}


def is_sharded(args, env) -> bool:
    """FSDP over several processes: sharded weights, optimizer state and checkpoints."""
    return args.parallel == "fsdp" and env.distributed


def resolve_settings(args, env, config, tokens_per_step: int, resumed: dict | None = None) -> RunSettings:
    """The run's settings for the model `config` training on tokens_per_step tokens per optimizer
    step; resumed: the record of the checkpoint it resumes ({} or None: a new run)."""
    resumed = resumed or {}
    sharded = is_sharded(args, env)
    dtype, why = detect_dtype(args.dtype, env.device, sharded=sharded)
    Logger(f"dtype: {dtype} ({why})")
    share = muon_flop_share(config, tokens_per_step, args.max_seq_len) if args.optimizer == "auto" else 0.0
    optimizer, why = detect_optimizer(args.optimizer, env.device, dtype, args.param_groups, share,
                                      resumed.get("optimizer"))
    Logger(f"optimizer: {optimizer} ({why})")
    recipe = {}
    for name in RECIPE_FLAGS:
        recipe[name], why = resolve_recipe(name, getattr(args, name), optimizer, resumed,
                                           hidden_size=config.hidden_size)
        Logger(f"{name}: {recipe[name]} ({why})")
    return RunSettings(dtype, optimizer, sharded, **recipe)
