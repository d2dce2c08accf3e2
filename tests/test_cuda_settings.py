"""Per-process CUDA settings, without a GPU (the calls the trainer makes are recorded
instead of reaching CUDA), and DDP's arguments on an older torch."""
import pytest
import torch

from trainer.parallel import no_buffer_sync
from trainer.train_pretrain import configure_cuda


@pytest.fixture
def cuda_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(torch.device(device).index))
    precision = torch.get_float32_matmul_precision()
    yield calls
    torch.set_float32_matmul_precision(precision)


def test_single_process_on_cuda_n_makes_n_current_and_fp32_uses_tf32(cuda_calls):
    torch.set_float32_matmul_precision("highest")
    configure_cuda("cuda:1", torch.float32)
    assert cuda_calls == [1]
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("device, dtype, current", [("cuda", torch.bfloat16, []), ("cuda:0", torch.bfloat16, [0]),
                                                    ("cpu", torch.float32, [])])
def test_other_runs_keep_full_fp32_matmuls(cuda_calls, device, dtype, current):
    torch.set_float32_matmul_precision("highest")
    configure_cuda(device, dtype)
    assert cuda_calls == current
    assert torch.get_float32_matmul_precision() == "highest"


def test_ddp_buffer_sync_is_off_with_the_argument_this_torch_has():
    assert no_buffer_sync() == {"forward_sync_buffers": False}  # the pinned torch 2.13

    class OlderDDP:  # DistributedDataParallel's signature before torch 2.13
        def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True):
            pass

    assert no_buffer_sync(OlderDDP) == {"broadcast_buffers": False}
