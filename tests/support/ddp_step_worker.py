"""Run one `optimizer_step` of the trainer on fixed batches, as 1 process or under
torchrun (the tests fork its ranks: tests/support/forked_ranks.py), and save the loss and the
updated weights for comparison.

    python tests/support/ddp_step_worker.py OUT.pt BATCH ACCUM      (or under torchrun)

SGD (lr 0.5) instead of AdamW: Adam's first update is lr * g/|g|, which turns float
noise in near-zero gradients into lr-sized differences; with SGD the updated weights
are a direct, amplified image of the averaged gradients.
"""
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.distributed import cleanup_distributed, init_distributed_mode  # noqa: E402
from trainer.step import TrainParts, optimizer_step  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 32


def global_batch():
    """The same 8 samples on every rank, with padding of varied length so that
    per-token weighting across micro-batches and ranks matters."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (GLOBAL_BATCH, SEQ), generator=g)
    labels = ids.clone()
    for i in range(GLOBAL_BATCH):
        pad_from = SEQ - 3 * i
        ids[i, pad_from:] = 0
        labels[i, pad_from:] = -100
    return ids, labels


def main(out_path, batch, accum):
    env = init_distributed_mode("cpu")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512))
    net = torch.nn.parallel.DistributedDataParallel(model) if env.distributed else model
    ids, labels = global_batch()
    # Same layout as the sampler: rank r owns positions r, r+W, ...; micro-batch i takes b of them.
    mine = list(range(env.rank, GLOBAL_BATCH, env.world_size))
    micro = [(ids[mine[i * batch:(i + 1) * batch]], labels[mine[i * batch:(i + 1) * batch]]) for i in range(accum)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    parts = TrainParts(model, net, optimizer, scaler, nullcontext(), env.device, env.world_size, bos_id=1)
    result = optimizer_step(parts, micro)
    if env.rank == 0:
        torch.save({"loss": result.mean_loss(), "weights": model.state_dict()}, out_path)
    del net, model, optimizer
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
