"""Muon's step alone on the block matrices of a model (default: the 64M model, hidden 768 x
8 layers), torch.optim.Muon against trainer/muon.py, with AdamW's step as the baseline.

    python scripts/bench_optimizer.py                       # CPU: 1 process, then 2 on gloo
    python scripts/bench_optimizer.py --settings cuda        # one GPU (ours compiled)
    python scripts/bench_optimizer.py --hidden_size 256 --num_hidden_layers 4 --steps 3

Every variant steps the same matrices with the same fixed gradients. The table gives the
median milliseconds per optimizer step; that time as a ratio to AdamW's step
(torch.optim.AdamW, fused, as the trainer runs it; the optimizer step alone, where
--optimizer auto's 1.75x bound is on the whole training step, forward and backward included:
scripts/bench_pretrain.py --variants mk); the speed-up over torch.optim.Muon; and the Newton-Schulz
matmul FLOPs one rank runs per step (torch's FlopCounterMode, on an eager twin of the
variant; AdamW runs none). torch.optim.Muon orthogonalises every matrix on every rank in
bf16, one after another; ours stacks matrices of one shape, splits each stack across the
ranks of a process group and works in the precision it is given; with NorMuon (the trainer's
default for a new run) it also rescales each update's rows. With 2 processes each rank
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
from common.cli import OneLineArgumentParser  # noqa: E402
from trainer.device import native_bf16_cpu_flags, read_cpu_flags  # noqa: E402
from trainer.optim import Muon  # noqa: E402
from trainer.optim import is_block_matrix  # noqa: E402

# name: (optimizer class, Newton-Schulz dtype, whether its work is split across ranks, NorMuon)
ADAMW = "torch.optim.AdamW (fused)"
TORCH_MUON = "torch.optim.Muon (bf16)"
VARIANTS = {
    ADAMW: ("adamw", None, False, False),
    TORCH_MUON: ("torch", torch.bfloat16, False, False),
    "ours, bf16": ("ours", torch.bfloat16, True, False),
    "ours, bf16 + NorMuon (the trainer's default)": ("ours", torch.bfloat16, True, True),
    "ours, fp32": ("ours", torch.float32, True, False),
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


def make_optimizer(name: str, params, group, compile_update: bool) -> torch.optim.Optimizer:
    kind, dtype, split, normuon = VARIANTS[name]
    if kind == "adamw":  # the trainer's AdamW (trainer/optim.py): fused on CPU and CUDA alike
        return torch.optim.AdamW(params, lr=5e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    if kind == "torch":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    return Muon(params, lr=0.02, weight_decay=0.01, ns_dtype=dtype, process_group=group if split else None,
                compile_update=compile_update, normuon=normuon)


def newton_schulz_gflop(name: str, shapes, device, group) -> float:
    """The matmul GFLOP one step of the variant runs on this rank, counted on an eager twin:
    under FlopCounterMode (a dispatch mode) dynamo does not compile, and a compiled graph's
    kernels would not be counted anyway."""
    optimizer = make_optimizer(name, block_matrices(shapes, device), group, compile_update=False)
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    return counter.get_total_flops() / 1e9


def time_variant(name: str, args, device, group) -> tuple[float, float]:
    """(median s/step, Newton-Schulz GFLOP this rank ran per step)."""
    shapes = block_shapes(args.hidden_size, args.num_hidden_layers)
    gflop = newton_schulz_gflop(name, shapes, device, group)
    optimizer = make_optimizer(name, block_matrices(shapes, device), group, compile_update=device.type == "cuda")
    # The untimed warm-up, and on CUDA the compile: outside any dispatch mode, since dynamo skips a
    # frame first called under one (FlopCounterMode) and then never compiles it.
    optimizer.step()
    times = []
    for _ in range(args.steps):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), gflop


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
    print(f"One optimizer step on the {matrices} block matrices of hidden {args.hidden_size} x "
          f"{args.num_hidden_layers} layers; CPU native bf16: {native}; torch {torch.__version__}; "
          f"median of {args.steps} steps")
    labels = {"one": f"1 process, {args.threads} threads", "two": "2 processes (gloo), 1 thread each",
              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"}
    print("| setting | optimizer | ms/step | / AdamW's step | speed-up over torch.optim.Muon "
          "| Newton-Schulz GFLOP per rank per step |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        results = run_setting(setting, args)
        adamw, torch_muon = results[ADAMW][0], results[TORCH_MUON][0]
        for name in VARIANTS:
            seconds, gflop = results[name]
            speed_up = "-" if name == ADAMW else f"{torch_muon / seconds:.2f}x"
            print(f"| {labels[setting]} | {name} | {seconds * 1e3:.2f} | {seconds / adamw:.2f}x | {speed_up} "
                  f"| {gflop:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
