"""Pre-train MiniMind. One script for every launch:

    python trainer/train_pretrain.py                          # one process, CPU or GPU
    torchrun --nproc_per_node=N trainer/train_pretrain.py     # N processes, DDP
    torchrun --nnodes=2 --node_rank=R --master_addr=A --master_port=P --nproc_per_node=N trainer/train_pretrain.py
    python -m torch.distributed.launch --nproc_per_node=N trainer/train_pretrain.py   # legacy launcher

The loop is trainer/loop.py's, which supervised fine-tuning (trainer/train_full_sft.py)
shares; its flags are trainer/config.py's. What is pre-training's own is its data: text, as
JSONL lines padded to --max_seq_len or as packed windows (trainer/data.py), by default the
demo corpus of standard-library docstrings, built on first use.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus  # noqa: E402
from trainer.config import PRETRAIN_DESCRIPTION  # noqa: E402
from trainer.data import build_data  # noqa: E402
from trainer.loop import Stage, run  # noqa: E402

PRETRAIN = Stage(
    description=PRETRAIN_DESCRIPTION,
    build_data=build_data,
    demo_data=DEMO_CORPUS,
    build_demo=ensure_demo_corpus,
)


def main(argv=None):
    run(PRETRAIN, argv)


if __name__ == "__main__":
    main()
