"""Muon's step alone on the block matrices of a model (default: the 64M model, hidden 768 x
8 layers), torch.optim.Muon against trainer/muon.py, side by side.

    python scripts/bench_optimizer.py                       # CPU: 1 process, then 2 on gloo
    python scripts/bench_optimizer.py --settings cuda        # one GPU (ours compiled)
    python scripts/bench_optimizer.py --hidden_size 256 --num_hidden_layers 4 --steps 3

Every variant steps the same matrices with the same fixed gradients. The table gives the
median seconds per optimizer step and the Newton-Schulz matmul FLOPs one rank runs per
step (torch's FlopCounterMode). torch.optim.Muon orthogonalises every matrix on every rank
in bf16, one after another; ours stacks matrices of one shape, splits each stack across the
ranks of a process group and works in the precision it is given. With 2 processes each rank
runs one thread (and the single process --threads), so on a 2-core machine both use the
whole CPU.
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
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.cli import OneLineArgumentParser  # noqa: E402
from trainer.device import native_bf16_cpu_flags, read_cpu_flags  # noqa: E402
from trainer.muon import Muon  # noqa: E402
from trainer.optim import is_block_matrix  # noqa: E402

# name: (optimizer class, Newton-Schulz dtype, whether its work is split across ranks)
VARIANTS = {
    "torch.optim.Muon (bf16)": ("torch", torch.bfloat16, False),
    "ours, bf16": ("ours", torch.bfloat16, True),
    "ours, fp32": ("ours", torch.float32, True),
}


def block_shapes(hidden: int, layers: int) -> list[torch.Size]:
    """The shapes of the model's Muon parameters (the model is built on the meta device: no memory)."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers))
    return [p.shape for n, p in model.named_parameters() if is_block_matrix(n, p)]


def block_matrices(shapes, device) -> list[torch.nn.Parameter]:
    """Parameters of these shapes with fixed gradients, the same in every process."""
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).mul_(0.02).to(device))
        p.grad = torch.randn(shape, generator=g).mul_(1e-3).to(device)
        params.append(p)
    return params


def time_variant(name: str, args, device, group) -> tuple[float, float]:
    """(median s/step, Newton-Schulz GFLOP this rank ran per step)."""
    kind, dtype, split = VARIANTS[name]
    params = block_matrices(block_shapes(args.hidden_size, args.num_hidden_layers), device)
    if kind == "torch":
        optimizer = torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    else:
        optimizer = Muon(params, lr=0.02, weight_decay=0.01, ns_dtype=dtype, process_group=group if split else None,
                         compile_ns=device.type == "cuda")
    with FlopCounterMode(display=False) as counter:
        optimizer.step()  # also the warm-up (and, on CUDA, the compile)
    times = []
    for _ in range(args.steps):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), counter.get_total_flops() / 1e9


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, world: int, store_path: str, args, results):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for name in VARIANTS:
        seconds, gflop = time_variant(name, args, torch.device("cpu"), dist.group.WORLD)
        if rank == 0:
            results[name] = (seconds, gflop)
    dist.destroy_process_group()


def run_setting(setting: str, args) -> dict:
    if setting == "one":
        torch.set_num_threads(args.threads)
        return {name: time_variant(name, args, torch.device("cpu"), None) for name in VARIANTS}
    if setting == "cuda":
        return {name: time_variant(name, args, torch.device("cuda"), None) for name in VARIANTS}
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, os.path.join(tmp, "store"), args, results), nprocs=2)
        return dict(results)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default=None, help="comma-separated: one, two (gloo), cuda (default: one,two, "
                                                    "and cuda where present)")
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up step")
    p.add_argument("--threads", type=int, default=2, help="threads of the single CPU process")
    args = p.parse_args(argv)
    settings = (args.settings or ("one,two,cuda" if torch.cuda.is_available() else "one,two")).split(",")
    native = "/".join(native_bf16_cpu_flags(read_cpu_flags())) or "none (bf16 emulated)"
    matrices = len(block_shapes(args.hidden_size, args.num_hidden_layers))
    print(f"Muon on the {matrices} block matrices of hidden {args.hidden_size} x {args.num_hidden_layers} layers; "
          f"CPU native bf16: {native}; torch {torch.__version__}; median of {args.steps} steps")
    labels = {"one": f"1 process, {args.threads} threads", "two": "2 processes (gloo), 1 thread each",
              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"}
    print("| setting | optimizer | s/step | speed-up over torch.optim.Muon | Newton-Schulz GFLOP per rank per step |")
    print("|---|---|---|---|---|")
    for setting in settings:
        results = run_setting(setting, args)
        base = results["torch.optim.Muon (bf16)"][0]
        for name, (seconds, gflop) in results.items():
            print(f"| {labels[setting]} | {name} | {seconds:.3f} | {base / seconds:.2f}x | {gflop:,.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
