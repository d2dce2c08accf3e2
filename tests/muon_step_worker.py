"""Run STEPS `optimizer_step`s of the trainer with --optimizer muon on fixed batches,
as 1 process or under torchrun (DDP or FSDP; the tests fork its ranks: tests/forked_ranks.py),
and save the loss and weights.

    python tests/muon_step_worker.py OUT.pt ddp|fsdp      (or under torchrun)

Every rank sees its half of the same global batch, so a correct data-parallel Muon
(the orthogonalisation of the averaged, full gradient) matches one process on the whole batch.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.optim import OptimConfig, build_optimizer  # noqa: E402
from trainer.parallel import full_state_dict, wrap_model  # noqa: E402
from trainer.step import StepContext, optimizer_step  # noqa: E402
from trainer.trainer_utils import cleanup_distributed, init_distributed_mode  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS = 8, 32, 3


def batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 500, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, ids.clone()


def main(out_path, parallel):
    env = init_distributed_mode("cpu")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512))
    net = wrap_model(model, env, parallel, dtype="float32")
    optimizer = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-2, muon_lr=0.02))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ctx = StepContext(net, optimizer, scaler, env.device, env.world_size, bos_id=1)
    mine = list(range(env.rank, GLOBAL_BATCH, env.world_size))
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step)
        result = optimizer_step(ctx, [(ids[mine], labels[mine])])
        losses.append(result.mean_loss())
    weights = full_state_dict(model)
    if env.rank == 0:
        torch.save({"losses": losses, "weights": weights}, out_path)
    del net, model, optimizer
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
