"""Counting device-to-host reads: the property the loop's speed on a GPU rests on."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountHostReads(TorchDispatchMode):
    """Counts device-to-host scalar reads (aten._local_scalar_dense: `.item()`, `bool(t)`,
    `float(t)`); on a GPU each one stalls the host until the queued kernels have run."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))
