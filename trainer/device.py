"""The machine a process trains on: its device (resolve_device, the one place that decides
it), what that hardware does natively (bf16 matmuls on this CPU, by AMX tiles or AVX-512 BF16
dot products, or on this GPU, Ampere and later), and the per-run settings that follow from the
dtype. What --dtype auto and --optimizer auto make of these facts is trainer/auto.py's."""
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
