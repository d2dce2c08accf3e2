"""What the flags leave to the machine, decided once at start-up: --dtype auto and
--optimizer auto become names, each with the reason it is logged with, and the run uses
these instead of the flags. The hardware facts come in as arguments (resolve_*), or are
read from this machine (detect_*), so the rules are tested for every machine on any one."""
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from trainer.device import cuda_has_native_bf16, native_bf16_cpu_flags, read_cpu_flags
from trainer.distributed import Logger


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


# --optimizer auto's criterion: the most a Muon step may cost, in AdamW steps (see resolve_optimizer).
MUON_STEP_BOUND = 1.25


def resolve_optimizer(flag: str, device_type: str, dtype: str, cpu_flags=frozenset(),
                      param_groups: str = "split") -> tuple[str, str]:
    """(optimizer name, why) for --optimizer `flag`, once the run's dtype is known.

    auto: Muon wherever its Newton-Schulz runs in a precision the hardware does natively: fp32
    runs on every CPU, bf16 runs on CPUs and GPUs with native bf16. AdamW where Newton-Schulz
    would run emulated or far below the run's own matmul rate. The criterion behind the rule:
    a Muon step costs at most MUON_STEP_BOUND (1.25) AdamW steps there. Its measurement is
    recorded in docs/performance.md, section "Muon": the table of scripts/bench_pretrain.py's
    variants b (the default, Muon) and k (AdamW), and scripts/bench_optimizer.py's step times
    as a ratio to AdamW's.
    """
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
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    return "muon", (f"auto: Newton-Schulz in {precision}, the run's own precision, native here, "
                    f"where a Muon step costs at most {MUON_STEP_BOUND}x an AdamW step")


def detect_dtype(flag: str, device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """resolve_dtype with this machine's facts."""
    on_cuda = device.type == "cuda"
    return resolve_dtype(flag, device.type, cpu_flags=frozenset() if on_cuda else read_cpu_flags(),
                         cuda_bf16=cuda_has_native_bf16(device) if on_cuda else False, sharded=sharded)


def detect_optimizer(flag: str, device: torch.device, dtype: str, param_groups: str = "split") -> tuple[str, str]:
    """resolve_optimizer with this machine's facts."""
    cpu_flags = read_cpu_flags() if device.type == "cpu" else frozenset()
    return resolve_optimizer(flag, device.type, dtype, cpu_flags=cpu_flags, param_groups=param_groups)


@dataclass(frozen=True)
class RunSettings:
    dtype: str  # float32 | bfloat16 | float16
    optimizer: str  # adamw | muon
    sharded: bool  # FSDP over several processes: sharded weights, optimizer state and checkpoints

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def autocast(self, device: torch.device) -> AbstractContextManager:
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(device.type, dtype=self.torch_dtype)

    def as_flags(self, args, accumulation_steps: int) -> dict:
        """The flags with what the run resolved in place of auto and of the derived values
        (what wandb records): the dtype, the optimizer and, under --global_batch_size, the
        accumulation steps it implies."""
        return {**vars(args), "dtype": self.dtype, "optimizer": self.optimizer,
                "accumulation_steps": accumulation_steps}


def resolve_settings(args, env) -> RunSettings:
    sharded = args.parallel == "fsdp" and env.distributed
    dtype, why = detect_dtype(args.dtype, env.device, sharded=sharded)
    Logger(f"dtype: {dtype} ({why})")
    optimizer, why = detect_optimizer(args.optimizer, env.device, dtype, args.param_groups)
    Logger(f"optimizer: {optimizer} ({why})")
    return RunSettings(dtype, optimizer, sharded)
