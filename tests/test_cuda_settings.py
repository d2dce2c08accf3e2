"""Per-process CUDA settings and the older-torch check, without a GPU: the calls the
trainer makes are recorded instead of reaching CUDA."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.parallel import require_kwargs
from trainer.train_pretrain import configure_cuda
from trainer.trainer_utils import UserError


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


def test_an_argument_this_torch_lacks_is_one_line_naming_it_and_the_fix():
    require_kwargs(DistributedDataParallel, ["forward_sync_buffers"], since="2.13")  # the pinned torch has it
    with pytest.raises(UserError) as error:
        require_kwargs(DistributedDataParallel, ["sync_everything_twice"], since="9.0")
    message = str(error.value)
    assert "\n" not in message
    assert "DistributedDataParallel(sync_everything_twice=...)" in message
    assert "pip install -r requirements.txt" in message
