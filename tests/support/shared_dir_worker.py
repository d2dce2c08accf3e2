"""Run common/storage.check_output_dirs in 2 processes (torchrun, or the tests' forked
ranks) and record what each rank decided.

    torchrun --standalone --nproc_per_node=2 tests/support/shared_dir_worker.py ROOT

Each rank writes ROOT/rank{r}.json: {case: the error line, or null}. The "not shared"
case gives each rank its own --checkpoint_dir, as two nodes with local disks would see.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.errors import UserError  # noqa: E402
from common.storage import check_output_dirs  # noqa: E402
from trainer.distributed import TORCH_COLLECTIVES, cleanup_distributed, init_distributed_mode  # noqa: E402


def decision(save_dir, checkpoint_dir, sharded):
    try:
        check_output_dirs(str(save_dir), str(checkpoint_dir), sharded, TORCH_COLLECTIVES)
    except UserError as exc:
        return str(exc)
    return None


def main(root):
    env = init_distributed_mode("cpu")
    root = Path(root)
    rank_dir = root / f"node{env.rank}"  # a folder only this rank looks at
    results = {
        "fsdp_shared": decision(root / "out", root / "ckpt", sharded=True),
        "fsdp_not_shared": decision(root / "out", rank_dir, sharded=True),
        # DDP: only rank 0 writes, so only rank 0's view counts; every rank must still stop.
        "ddp_rank0_dir_is_a_file": decision(root / "out", root / "a_file" if env.rank == 0 else rank_dir, False),
    }
    (root / f"rank{env.rank}.json").write_text(json.dumps(results))
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
