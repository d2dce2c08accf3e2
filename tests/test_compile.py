"""--use_compile 1 with 2 processes trains like eager: torch.compile around the DDP module
(dynamo splits the graph at DDP's buckets), and per-block compile inside FSDP2. The eager
run is torchrun's (shared with test_clean_shutdown); the compiled ranks are forked from
the preloaded trainer (tests/support/forked_ranks.py)."""
import pytest
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model.model_minimind import MiniMindForCausalLM
from tests.support.assertions import assert_clean_exit, max_abs_diff
from tests.support.jobs import JobSpec, run_all
from tests.support.run_outputs import checkpoint_name, latest_checkpoint, load_checkpoint, out_args
from tests.support.tiny import THREE_STEPS
from trainer.config import parse_config
from trainer.trainer_utils import model_config, setup_seed

STEPS = 3
BASE = THREE_STEPS  # lr 5e-4 and a long --dist_timeout: see tests/support/tiny.py


@pytest.mark.slow
def test_compiled_ddp_and_fsdp_match_eager_ddp(tmp_path, shared_runs):
    eager_dir, eager_run = shared_runs({"eager_ddp": (2, BASE)})["eager_ddp"]
    jobs = {
        "ddp": JobSpec([*BASE, *out_args(tmp_path / "ddp"), "--use_compile", "1"], tmp_path / "ddp", nproc=2,
                       mode="forked"),
        "fsdp": JobSpec([*BASE, *out_args(tmp_path / "fsdp"), "--use_compile", "1", "--parallel", "fsdp"],
                        tmp_path / "fsdp", nproc=2, mode="forked"),
    }
    done = {"eager": eager_run, **run_all(jobs, timeout=600)}
    for name, result in done.items():
        assert_clean_exit(result.returncode, result.stdout, name)
    eager = latest_checkpoint(eager_dir)["model"]
    compiled_ddp = latest_checkpoint(tmp_path / "ddp")["model"]
    dcp_to_torch_save(tmp_path / "fsdp" / "ckpt" / checkpoint_name(STEPS, sharded=True), tmp_path / "fsdp.pt")
    compiled_fsdp = load_checkpoint(tmp_path / "fsdp.pt")["model"]

    assert max_abs_diff(compiled_ddp, eager) <= 1e-5
    assert max_abs_diff(compiled_fsdp, eager) <= 1e-5
    # Not vacuous: three steps moved the weights far beyond the tolerance from where they began.
    cfg = parse_config(BASE)[0]
    setup_seed(cfg.optim.seed)
    initial = MiniMindForCausalLM(model_config(cfg)).state_dict()
    key = "model.embed_tokens.weight"
    assert (eager[key] - initial[key]).abs().max() > 1e-4
