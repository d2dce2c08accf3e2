"""Per-process CUDA settings, without a GPU (the calls the trainer makes are recorded
instead of reaching CUDA), and DDP's arguments on an older torch."""
import pytest
import torch

from trainer.device import configure_cuda
from trainer.distributed import init_distributed_mode
from trainer.distributed import no_buffer_sync


@pytest.fixture
def cuda_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(torch.device(device).index))
    precision = torch.get_float32_matmul_precision()
    yield calls
    torch.set_float32_matmul_precision(precision)


def test_a_single_process_on_cuda_n_makes_n_current(cuda_calls, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    env = init_distributed_mode(torch.device("cuda", 1))
    assert cuda_calls == [1] and env.device == torch.device("cuda", 1)
    assert init_distributed_mode(torch.device("cpu")).device.type == "cpu" and cuda_calls == [1]


def test_an_fp32_cuda_run_uses_tf32(cuda_calls):
    torch.set_float32_matmul_precision("highest")
    configure_cuda(torch.device("cuda", 1), torch.float32)
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("device, dtype", [("cuda:0", torch.bfloat16), ("cpu", torch.float32)])
def test_other_runs_keep_full_fp32_matmuls(cuda_calls, device, dtype):
    torch.set_float32_matmul_precision("highest")
    configure_cuda(torch.device(device), dtype)
    assert torch.get_float32_matmul_precision() == "highest"


def test_ddp_buffer_sync_is_off_with_the_argument_this_torch_has():
    assert no_buffer_sync() == {"forward_sync_buffers": False}  # the pinned torch 2.13

    class OlderDDP:  # DistributedDataParallel's signature before torch 2.13
        def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True):
            pass

    assert no_buffer_sync(OlderDDP) == {"broadcast_buffers": False}
