"""Supervised fine-tuning of MiniMind on conversations: a pre-trained model learns to answer.
Launched the four ways pre-training is:

    python trainer/train_full_sft.py                          # one process, CPU or GPU
    torchrun --nproc_per_node=N trainer/train_full_sft.py     # N processes, DDP
    torchrun --nnodes=2 --node_rank=R --master_addr=A --master_port=P --nproc_per_node=N trainer/train_full_sft.py
    python -m torch.distributed.launch --nproc_per_node=N trainer/train_full_sft.py   # legacy launcher

The loop is trainer/loop.py's, the one pre-training runs: resume, checkpoints, DDP and FSDP2,
the global batch, preemption, elastic restarts, metrics and the profiler are its. What is
fine-tuning's own: its data, conversations in MiniMind's JSONL (padded) or packed by
`scripts/prepare_data.py --sft` (dataset/sft_dataset.py), the loss on the assistant's replies
only (dataset/chat.py); its first weights, by default the pre-trained ones
(--from_weight pretrain: {save_dir}/pretrain_{hidden}[_moe].pth); and its defaults, MiniMind's
(2 epochs, batch 16, --save_weight full_sft) but for the learning rates, measured for our
model sizes (docs/sft.md).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.demo_sft import DEMO_SFT, ensure_demo_sft  # noqa: E402
from trainer.data import build_sft_data  # noqa: E402
from trainer.loop import Stage, run  # noqa: E402

# Fine-tuning's defaults, where they differ from pre-training's (trainer/config.py).
SFT_DEFAULTS = {
    "save_weight": "full_sft", "from_weight": "pretrain", "data_path": str(DEMO_SFT),
    "wandb_project": "MiniMind-Full-SFT", "epochs": 2, "batch_size": 16, "max_seq_len": 768,
    "learning_rate": 3e-4, "muon_lr": 2e-3,
    # The schedule, plain Muon and AdamW's betas that the lr sweep of docs/sft.md measured (MiniMind's cosine); the
    # pre-training defaults were chosen on pre-training.
    "lr_schedule": "cosine", "normuon": 0, "weight_decay": 0.01, "adam_betas": (0.9, 0.95),
    "doc_mask": 1,  # packed windows hold several conversations: each attends to itself only, whatever the optimizer
}

SFT_HELP = {
    "data_path": "conversations: a .jsonl of MiniMind's {\"conversations\": [...]} lines (padded), or the .bin "
                 "that scripts/prepare_data.py --sft makes of one (packed)",
    "val_data_path": "held-out conversations (.jsonl or .bin)",
    "learning_rate": "AdamW's peak lr (MiniMind's SFT: 1e-5, for AdamW on everything)",
    "doc_mask": "packed data: each conversation attends to itself only (FlexAttention on A100/H100/B200, a dense "
                "mask elsewhere)",
    "eval_task": "a multiple-choice task (.jsonl, as dataset/tasks/ holds), its questions asked as chat turns, "
                 "scored with validation",
}

SFT = Stage(
    description="MiniMind supervised fine-tuning on conversations (single process, torchrun DDP/FSDP, multi-node)",
    build_data=build_sft_data,
    demo_data=DEMO_SFT,
    build_demo=ensure_demo_sft,
    groups=("output", "optim", "model", "data", "chat", "system"),
    defaults=SFT_DEFAULTS,
    help=SFT_HELP,
    chat=True,
)


def main(argv=None):
    run(SFT, argv)


if __name__ == "__main__":
    main()
