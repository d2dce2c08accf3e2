"""The device a process trains on, and what that hardware does natively: bf16 matmuls
on this CPU (AMX tiles or AVX-512 BF16 dot products) or on this GPU (Ampere and later)."""
import torch

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


def cuda_has_native_bf16(device: str) -> bool:
    """Ampere (capability 8.0) or newer; emulated bf16 on older GPUs is slower than fp16."""
    index = torch.device(device).index or 0
    return (torch.cuda.get_device_capability(index) >= (8, 0)
            and torch.cuda.is_bf16_supported(including_emulation=False))
