"""The subcommands of scripts/bench/bench_ops.py timed over the ranks of a process group: `optimizer`
(Muon's step alone) and `ddp` (what DDP costs around a training step). Their several processes
are a torchrun job of bench_ops.py itself (scripts/dev/launching.py's launch), whose rank 0 prints
its figures for the table."""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.dev.launching import alternate, launch, median_seconds, print_result, read_result, row, table
from trainer.device import native_bf16_cpu_flags, read_cpu_flags
from trainer.distributed import no_buffer_sync
from trainer.optim import Muon, is_block_matrix

BENCH_OPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_ops.py")


def run_ranks(subcommand: str, flags: list, nproc: int, threads: int):
    """Rank 0's figures of `bench_ops.py SUBCOMMAND --worker FLAGS` under torchrun with nproc processes."""
    return read_result(launch([subcommand, "--worker", *flags], script=BENCH_OPS, nproc=nproc,
                              env={"OMP_NUM_THREADS": str(threads)}))


def start_group(device: torch.device):
    """This torchrun rank's process group: NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def in_step(device: torch.device, group=None):
    """What the timer calls around each step: the ranks start together, and CUDA has finished."""
    def sync():
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sync


# ---------------------------------------------------------------------------- optimizer
def optimizer_args(p):
    """Muon's step alone on the block matrices of a model: ours against torch.optim.Muon and AdamW.

    Every variant steps the same matrices (by default those of the 64M model, hidden 768 x 8
    layers) with the same fixed gradients. The table gives the median milliseconds per optimizer
    step; its ratio to AdamW's step (torch.optim.AdamW, fused, as the trainer runs it: the step
    alone, where --optimizer auto's bound is on the whole training step, which `bench_train.py
    throughput --variants mk` times); the speed-up over torch.optim.Muon; and the Newton-Schulz
    matmul FLOPs one rank runs per step (torch's FlopCounterMode, on an eager twin of the variant).
    torch.optim.Muon orthogonalises every matrix on every rank in bf16, one after another; ours
    stacks matrices of one shape, splits each stack across the ranks of a process group, works in
    the precision it is given and, with NorMuon (the trainer's default), rescales each update's
    rows. With 2 processes each rank runs one thread (the single process --threads), so on a
    2-core machine both use the whole CPU; on CUDA ours is compiled."""
    p.add_argument("--settings", default=None,
                   help="comma-separated: one, two (gloo), cuda (default: one,two, and cuda where present)")
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up step")
    p.add_argument("--threads", type=int, default=2, help="threads of the single CPU process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the job it starts


ADAMW, TORCH_MUON = "torch.optim.AdamW (fused)", "torch.optim.Muon (bf16)"
# name: (optimizer, Newton-Schulz dtype, whether its work is split across ranks, NorMuon)
OPTIMIZERS = {
    ADAMW: ("adamw", None, False, False),
    TORCH_MUON: ("torch", torch.bfloat16, False, False),
    "ours, bf16": ("ours", torch.bfloat16, True, False),
    "ours, bf16 + NorMuon (the trainer's default)": ("ours", torch.bfloat16, True, True),
    "ours, fp32": ("ours", torch.float32, True, False),
}


def block_shapes(hidden: int, layers: int) -> list[torch.Size]:
    """The shapes of the model's Muon parameters (built on the meta device: no memory)."""
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
    kind, dtype, split, normuon = OPTIMIZERS[name]
    if kind == "adamw":  # the trainer's AdamW (trainer/optim.py): fused on CPU and CUDA alike
        return torch.optim.AdamW(params, lr=5e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    if kind == "torch":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    return Muon(params, lr=0.02, weight_decay=0.01, ns_dtype=dtype, process_group=group if split else None,
                compile_update=compile_update, normuon=normuon)


def newton_schulz_gflop(name: str, shapes, device, group) -> float:
    """The matmul GFLOP of one step on this rank, counted on an eager twin: under FlopCounterMode (a
    dispatch mode) dynamo does not compile, and a compiled graph's kernels would not be counted."""
    optimizer = make_optimizer(name, block_matrices(shapes, device), group, compile_update=False)
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    return counter.get_total_flops() / 1e9


def time_optimizers(args, device, group=None) -> dict:
    """{variant: (median s/step, Newton-Schulz GFLOP this rank ran per step)}. Each variant's
    warm-up step (on CUDA, its compile) runs outside any dispatch mode: dynamo skips a frame first
    called under one and then never compiles it."""
    shapes, results = block_shapes(args.hidden_size, args.num_hidden_layers), {}
    for name in OPTIMIZERS:
        gflop = newton_schulz_gflop(name, shapes, device, group)
        optimizer = make_optimizer(name, block_matrices(shapes, device), group, compile_update=device.type == "cuda")
        results[name] = (median_seconds(optimizer.step, args.steps, warmup=1, sync=in_step(device, group)), gflop)
    return results


def optimizer(args):
    if args.worker:  # a rank of setting `two`
        torch.set_num_threads(1)
        start_group(torch.device("cpu"))
        results = time_optimizers(args, torch.device("cpu"), dist.group.WORLD)
        if dist.get_rank() == 0:
            print_result(results)
        dist.destroy_process_group()
        return
    settings = (args.settings or ("one,two,cuda" if torch.cuda.is_available() else "one,two")).split(",")
    native = "/".join(native_bf16_cpu_flags(read_cpu_flags())) or "none (bf16 emulated)"
    print(f"One optimizer step on the {len(block_shapes(args.hidden_size, args.num_hidden_layers))} block matrices "
          f"of hidden {args.hidden_size} x {args.num_hidden_layers} layers; CPU native bf16: {native}; "
          f"torch {torch.__version__}; median of {args.steps} steps")
    labels = {"one": f"1 process, {args.threads} threads", "two": "2 processes (gloo), 1 thread each",
              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"}
    table("setting", "optimizer", "ms/step", "/ AdamW's step", "speed-up over torch.optim.Muon",
          "Newton-Schulz GFLOP per rank per step")
    for setting in settings:
        if setting == "two":
            results = run_ranks("optimizer", ["--hidden_size", args.hidden_size, "--num_hidden_layers",
                                              args.num_hidden_layers, "--steps", args.steps], nproc=2, threads=1)
        else:
            torch.set_num_threads(args.threads)
            results = time_optimizers(args, torch.device("cuda" if setting == "cuda" else "cpu"))
        adamw, torch_muon = results[ADAMW][0], results[TORCH_MUON][0]
        for name, (seconds, gflop) in results.items():
            speed_up = "-" if name == ADAMW else f"{torch_muon / seconds:.2f}x"
            row(labels[setting], name, f"{seconds * 1e3:.2f}", f"{seconds / adamw:.2f}x", speed_up, f"{gflop:,.1f}")


# ---------------------------------------------------------------------------- ddp
def ddp_args(p):
    """What DDP costs around one training step, and which of its settings pay.

    Every variant trains the same model from the same weights on the same random tokens
    (forward, backward, fused AdamW), the variants taking turns step by step:
      no DDP            the step alone, no gradient exchange: the floor
      DDP, defaults     torch's defaults: gradients copied into the all-reduce buckets and back,
                        the RoPE buffers broadcast before every forward
      trainer's DDP     gradients as views of the buckets, no buffer broadcast (trainer/distributed.py)
      + static_graph    the trainer's, with the reducer told the graph never changes
      + 100 MB buckets  the trainer's, with bucket_cap_mb=100 instead of 25
    A one-process run of the trainer has no DDP at all (a world of one has nothing to average);
    at world size 1 the "DDP, defaults" row shows what wrapping it anyway would cost."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default: 1,2 on CPU, 1 on CUDA)")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of a one-process CPU run (1 each with 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the job it starts


TRAINERS = dict(gradient_as_bucket_view=True, **no_buffer_sync())
DDP_VARIANTS = {
    "no DDP": None,
    "DDP, defaults": {},
    "trainer's DDP": TRAINERS,
    "+ static_graph": {**TRAINERS, "static_graph": True},
    "+ 100 MB buckets": {**TRAINERS, "bucket_cap_mb": 100},
}


def training_step(options, args, device, tokens, autocast):
    """One variant's step: its model (wrapped in DDP with `options`, or not at all) and fused AdamW."""
    torch.manual_seed(0)  # the same initial weights in every variant
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=args.hidden_size,
                                               num_hidden_layers=args.num_hidden_layers)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    net = model if options is None else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, **options)

    def step():
        with autocast:
            loss = net(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def ddp_rank(args, dtype: str):
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    start_group(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(3, 6400, (args.batch_size, args.max_seq_len), generator=g).to(device)
    steps = {name: training_step(options, args, device, tokens, autocast) for name, options in DDP_VARIANTS.items()}
    times = alternate(steps, args.rounds * args.steps, args.warmup, sync=in_step(device, dist.group.WORLD))
    if dist.get_rank() == 0:
        print_result({name: statistics.median(seconds) for name, seconds in times.items()})
    dist.destroy_process_group()


def ddp(args):
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.worker:
        return ddp_rank(args, dtype)
    worlds = [int(w) for w in (args.worlds or ("1" if args.device == "cuda" else "1,2")).split(",")]
    print(f"hidden {args.hidden_size} x {args.num_hidden_layers} layers, seq {args.max_seq_len}, batch "
          f"{args.batch_size} per process, {dtype}, {args.device}; torch {torch.__version__}; median of "
          f"{args.rounds} x {args.steps} steps after {args.warmup} warm-up, the variants taking turns")
    table("processes", "variant", "s/step", "x no DDP")
    flags = ["--device", args.device, "--hidden_size", args.hidden_size, "--num_hidden_layers", args.num_hidden_layers,
             "--max_seq_len", args.max_seq_len, "--batch_size", args.batch_size, "--dtype", dtype,
             "--steps", args.steps, "--warmup", args.warmup, "--rounds", args.rounds]
    for world in worlds:
        results = run_ranks("ddp", flags, nproc=world, threads=args.threads if world == 1 else 1)
        for name, seconds in results.items():
            row(world, name, f"{seconds:.4f}", f"{seconds / results['no DDP']:.3f}x")


SUBCOMMANDS = {"optimizer": (optimizer_args, optimizer), "ddp": (ddp_args, ddp)}
