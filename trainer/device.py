"""The machine a process trains on: its device (resolve_device, the one place that decides
it), what that hardware does natively (bf16 matmuls on this CPU, by AMX tiles or AVX-512 BF16
dot products, or on this GPU, Ampere and later), and the two choices that follow from it,
--dtype auto and --optimizer auto. The hardware facts come in as arguments (resolve_*) or are
read from this machine (detect_*), so the rules are tested for every machine on any one."""
import os
import re
from contextlib import AbstractContextManager, nullcontext

import torch

from common.errors import UserError

# Either flag means the CPU runs bf16 matmuls natively.
NATIVE_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags (Linux); empty where there is no /proc/cpuinfo."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16_cpu_flags(cpu_flags) -> list[str]:
    """Which of the native-bf16 flags the CPU has (none: bf16 is emulated, and slower than fp32)."""
    return sorted(NATIVE_BF16_CPU_FLAGS & set(cpu_flags))


def cuda_has_native_bf16(device: torch.device) -> bool:
    """Ampere (capability 8.0) or newer; emulated bf16 on older GPUs is slower than fp16."""
    index = device.index or 0
    return (torch.cuda.get_device_capability(index) >= (8, 0)
            and torch.cuda.is_bf16_supported(including_emulation=False))


def launcher_local_rank(local_rank_flag: int | None = None, environ=os.environ) -> int:
    """This process's index on its node: torchrun exports LOCAL_RANK; the legacy launcher passes
    only --local-rank=N on the command line (older torch: --local_rank), so the environment wins."""
    return int(environ.get("LOCAL_RANK", local_rank_flag or 0))


def resolve_device(flag: str | None, local_rank_flag: int | None = None, environ=os.environ) -> torch.device:
    """The device this process trains on, for --device `flag`; a UserError says why a flag cannot be met.

    Without --device: cuda:LOCAL_RANK under a launcher (RANK set), cuda:0 for a single process,
    cpu where there is no GPU. Under a launcher every CUDA process takes cuda:LOCAL_RANK whatever
    N is, so one command serves every rank. Checked before any process group exists: a bad CUDA
    device would otherwise end in torch's AssertionError or an invalid-ordinal error on every rank.
    """
    launched = "RANK" in environ
    local_rank = launcher_local_rank(local_rank_flag, environ) if launched else 0
    if flag == "cpu" or (flag is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", flag or "cuda")
    if not match:
        raise UserError(f"--device {flag}: not a device this trainer runs on: pass --device cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise UserError(f"--device {flag}: {why}: pass --device cpu")
    count = torch.cuda.device_count()
    if launched and local_rank >= count:
        raise UserError(f"--device {flag or 'cuda (the default)'}: this process has LOCAL_RANK {local_rank} and "
                        f"takes cuda:{local_rank}, but {count} GPU(s) are visible: start at most {count} process(es) "
                        f"per node, or pass --device cpu")
    index = local_rank if launched else int(match[1] or 0)
    if index >= count:
        raise UserError(f"--device {flag}: GPU {index} does not exist, {count} GPU(s) visible: "
                        f"pass --device cuda:0 to cuda:{count - 1}, or --device cpu")
    return torch.device("cuda", index)


def configure_cuda(device: torch.device, dtype: torch.dtype):
    """Per-run CUDA settings, once the dtype is known (nothing to do on CPU; the current device
    is set when the process joins its group, trainer/distributed.py)."""
    if device.type == "cuda" and dtype == torch.float32:
        # fp32 matmuls on TF32 tensor cores: fp32 storage and accumulation, 10-bit mantissa
        # products, several times the plain fp32 rate on Ampere and later.
        torch.set_float32_matmul_precision("high")


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """The forward pass's precision: torch.autocast in `dtype`, or nothing for float32."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


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


def resolve_optimizer(device_type: str, dtype: str, cpu_flags=frozenset(), param_groups: str = "split",
                      muon_share: float = 0.0) -> tuple[str, str]:
    """(optimizer name, why) for --optimizer auto, once the run's dtype is known.

    Muon where a Muon step costs at most MUON_STEP_BOUND AdamW steps. That takes two things.
    Newton-Schulz must run in a precision the hardware does natively: fp32 on every CPU, bf16
    on CPUs and GPUs with native bf16 (not fp16 runs, whose Newton-Schulz would be fp32, nor
    emulated bf16). And its work, `muon_share` of the step's forward and backward FLOPs
    (trainer/metrics.py's muon_flop_share), must stay within the bound: at most 0.75.
    """
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


def detect_dtype(flag: str, device: torch.device, sharded: bool = False) -> tuple[str, str]:
    """resolve_dtype with this machine's facts."""
    on_cuda = device.type == "cuda"
    return resolve_dtype(flag, device.type, cpu_flags=frozenset() if on_cuda else read_cpu_flags(),
                         cuda_bf16=cuda_has_native_bf16(device) if on_cuda else False, sharded=sharded)


def detect_optimizer(device: torch.device, dtype: str, param_groups: str = "split",
                     muon_share: float = 0.0) -> tuple[str, str]:
    """resolve_optimizer with this machine's facts."""
    cpu_flags = read_cpu_flags() if device.type == "cpu" else frozenset()
    return resolve_optimizer(device.type, dtype, cpu_flags, param_groups, muon_share)
