"""Counting device-to-host reads: the property the loop's speed on a GPU rests on."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountHostReads(TorchDispatchMode):
    """Counts device-to-host reads: scalar reads (aten._local_scalar_dense: `.item()`, `bool(t)`,
    `float(t)`) and `.tolist()`, which reads a whole tensor at once and reaches no dispatch of
    its own on a CPU tensor, so it is counted where it is called. On a GPU each one stalls the
    host until the queued kernels have run."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            self.reads += 1
            return self._tolist(tensor)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))
