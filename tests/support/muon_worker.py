"""Three Muon steps (trainer/optim.py) on the tiny model's block matrices with fixed
gradients, in one process or split over the ranks of a process group: DDP replicas (each
rank orthogonalises its share) or FSDP2 shards (each matrix's owner works on the whole
matrix). Saves the final full weights and the Newton-Schulz matmul FLOPs this rank ran.

    python tests/support/muon_worker.py OUT_PREFIX none|ddp|fsdp [OPTIONS]      (the tests fork its ranks)

OPTIONS: "normuon" turns NorMuon on; without it, torch.optim.Muon's update. Every rank gives each parameter the same full
gradient (FSDP: its shard of it), so the three layouts must end with the same weights.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.distributed import cleanup_distributed, init_distributed_mode, replica_group, wrap_model  # noqa: E402
from trainer.optim import Muon, is_block_matrix  # noqa: E402

STEPS = 3


def gradient(step: int, index: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + index)) * 1e-2


def main(out_prefix: str, layout: str, options: str = ""):
    env = init_distributed_mode("cpu")
    torch.manual_seed(0)
    # hidden 64: stacks of 4 (q/o, k/v) and 6 (gate/up/down). Over 3 ranks the stacks of 4 split
    # 2/2/0, so DDP's rank 2 pads its share with zeros, and the intermediate 256 rows split
    # 86/86/84, so FSDP shards of unequal rows are exercised too.
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512))
    wrap_model(model, env, "fsdp" if layout == "fsdp" else "ddp")
    matrices = [(n, p) for n, p in model.named_parameters() if is_block_matrix(n, p)]
    optimizer = Muon([p for _, p in matrices], lr=0.02, weight_decay=0.01,
                     process_group=replica_group(env, "ddp") if layout == "ddp" else None,
                     normuon=options == "normuon")
    flops = 0
    for step in range(STEPS):
        for index, (_, p) in enumerate(matrices):
            full = gradient(step, index, p.shape)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
        with FlopCounterMode(display=False) as counter:
            optimizer.step()
        flops += counter.get_total_flops()
    whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    weights = {n: whole(p) for n, p in matrices}
    moments = {n: whole(optimizer.state[p]["row_second_moment"]) for n, p in matrices
               if "row_second_moment" in optimizer.state[p]}
    torch.save({"weights": weights, "moments": moments, "flops": flops, "world_size": env.world_size},
               f"{out_prefix}_rank{env.rank}.pt")
    del model, optimizer
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
