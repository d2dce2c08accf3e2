"""What DDP costs around one training step, and which of its settings pay.

    python scripts/bench_ddp.py                    # CPU: world size 1, then 2 processes on gloo
    python scripts/bench_ddp.py --device cuda      # one GPU: world size 1 on NCCL
    python scripts/bench_ddp.py --hidden_size 768 --num_hidden_layers 8 --max_seq_len 1024 --batch_size 32 --device cuda

Every variant trains the same model from the same weights on the same random tokens
(forward, backward, fused AdamW), in rounds that take the variants in turn, so a slow
moment of the machine falls on all of them alike. The variants:

    no DDP            the step alone, no gradient exchange: the floor
    DDP, defaults     torch's defaults: gradients copied into the all-reduce buckets and
                      back, the RoPE buffers broadcast before every forward
    trainer's DDP     gradients as views of the buckets, no buffer broadcast (trainer/parallel.py)
    + static_graph    the trainer's, with the reducer told the graph never changes
    + 100 MB buckets  the trainer's, with bucket_cap_mb=100 instead of 25

A one-process torchrun run has no DDP at all (trainer/parallel.py's replica_group): a
world of one has nothing to average, and its "DDP, defaults" row shows what wrapping it
anyway would cost.
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402
from trainer.distributed import no_buffer_sync  # noqa: E402

TRAINERS = dict(gradient_as_bucket_view=True, **no_buffer_sync())
VARIANTS = {
    "no DDP": None,
    "DDP, defaults": {},
    "trainer's DDP": TRAINERS,
    "+ static_graph": {**TRAINERS, "static_graph": True},
    "+ 100 MB buckets": {**TRAINERS, "bucket_cap_mb": 100},
}


def build(options, args, device):
    """(module to call, optimizer) for one variant, from the same initial weights every time."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers)
    model = MiniMindForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if options is None:
        return model, optimizer
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **options), optimizer


def one_step(net, optimizer, tokens, autocast):
    with autocast:
        loss = net(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_steps(net, optimizer, tokens, autocast, steps: int, device) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        one_step(net, optimizer, tokens, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def run_rank(rank: int, world: int, store_path: str, args, dtype: str, results):
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads if world == 1 else 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(3, 6400, (args.batch_size, args.max_seq_len), generator=g).to(device)
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, options in VARIANTS.items():
            net, optimizer = build(options, args, device)
            time_steps(net, optimizer, tokens, autocast, args.warmup, device)
            times[name] += time_steps(net, optimizer, tokens, autocast, args.steps, device)
            del net, optimizer
    if rank == 0:
        results.update({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def run_world(world: int, args, dtype: str) -> dict:
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(run_rank, args=(world, os.path.join(tmp, "store"), args, dtype, results), nprocs=world)
        return dict(results)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default: 1,2 on CPU, 1 on CUDA)")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of a one-process CPU run (1 each with 2)")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    worlds = [int(w) for w in (args.worlds or ("1" if args.device == "cuda" else "1,2")).split(",")]
    print(f"hidden {args.hidden_size} x {args.num_hidden_layers} layers, seq {args.max_seq_len}, batch "
          f"{args.batch_size} per process, {dtype}, {args.device}; torch {torch.__version__}; median of "
          f"{args.rounds} x {args.steps} steps after {args.warmup} warm-up per round")
    print("| processes | variant | s/step | x no DDP |")
    print("|---|---|---|---|")
    for world in worlds:
        results = run_world(world, args, dtype)
        for name, seconds in results.items():
            print(f"| {world} | {name} | {seconds:.4f} | {seconds / results['no DDP']:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
