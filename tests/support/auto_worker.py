"""trainer/auto.py's resolve_auto in a process group whose ranks read unlike hardware: rank 1
sees a CPU without bf16 (and so would take fp32 and AdamW), rank 0 this machine with bf16.
Writes what each rank decided.

    python tests/support/auto_worker.py OUT_PREFIX      (the tests fork its ranks)
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig  # noqa: E402
from trainer import auto  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.distributed import cleanup_distributed, init_distributed_mode  # noqa: E402


def main(out_prefix: str):
    env = init_distributed_mode("cpu")
    bf16 = frozenset({"avx2", "avx512f", "avx512_bf16"}) if env.rank == 0 else frozenset({"avx2"})
    auto.read_cpu_flags = lambda: bf16
    model = MiniMindConfig(hidden_size=256, num_hidden_layers=2)
    cfg = auto.resolve_auto(TrainConfig.of(), {}, torch.device("cpu"), False, model, 8 * 340)
    decided = {name: getattr(cfg.system if name == "dtype" else cfg.optim, name) for name in ("dtype", "optimizer")}
    Path(f"{out_prefix}_rank{env.rank}.json").write_text(json.dumps(decided))
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
