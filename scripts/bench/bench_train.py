"""Benchmarks that run the whole trainer, one subcommand and one table each:

    python scripts/bench/bench_train.py throughput [--variants abcdef] [--device cuda]  # data paths, launch modes, options
    python scripts/bench/bench_train.py memory [--parallel]    # peak memory: --grad_checkpointing; DDP against FSDP
    python scripts/bench/bench_train.py elastic                # how soon an elastic job goes on after losing a node
    python scripts/bench/bench_train.py prepare [--file_mb 10] # prepare_data.py on a large corpus; start-up on its shards

`python scripts/bench/bench_train.py SUBCOMMAND --help` gives each one's flags and what it measures.
Every run goes through scripts/dev/launching.py's launch (one process, or torchrun with N), and
runs compared in one table take turns (its alternate), so that a slow moment of the machine
falls on all of them alike.
"""
import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from common.cli import OneLineArgumentParser  # noqa: E402
from dataset.demo_corpus import DEMO_CORPUS  # noqa: E402
from scripts.bench import bench_startup  # noqa: E402
from scripts.bench.bench_startup import PREPARE, outputs  # noqa: E402
from scripts.dev.launching import (  # noqa: E402
    alternate, launch, median_seconds, print_result, read_result, row, stop_on_sigterm, subcommand_parser, table,
)
from trainer.config import run_prefix  # noqa: E402

DEMO_BIN = DEMO_CORPUS.with_suffix(".bin")


def metrics(run_dir: Path, hidden_size: int, kind: str = "train") -> list[dict]:
    """The rows of one kind in the metrics file of a run made with outputs(run_dir)."""
    path = run_dir / "out" / f"{run_prefix('pretrain', hidden_size, False)}_metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


# ---------------------------------------------------------------------------- throughput
def throughput_args(p):
    """Training throughput of the data paths, launch modes and options, side by side.

    Each variant is a real train_pretrain.py run on the same model and corpus:
      a  padded JSONL (MiniMind's PretrainDataset)
      b  packed .bin (PackedPretrainDataset; with Muon the document mask, the default)
      c  packed + --use_compile 1
      d  packed, torchrun with N processes (DDP; N = 2 on CPU, min(2, GPUs) on CUDA)
      e  packed, with glibc malloc tuned (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_)
      f  packed + --doc_mask 0 (attention across the whole window: beside b, what the document mask costs)
      g  packed, torchrun with N processes and --parallel fsdp
      h  packed, torchrun with N processes + --use_compile 1 (compiled around DDP)
      i  packed + --use_compile 1 --optimizer adamw (beside c: what Muon costs)
      j  packed + --use_compile 1 --doc_mask 0 (beside c: what the document mask costs)
      k  packed + --optimizer adamw (beside m: what Muon costs)
      m  packed + --optimizer muon (b's optimizer wherever --optimizer auto takes Muon)
      n  packed + --optimizer muon --normuon 0 (beside m: what NorMuon costs)
    Every process runs one thread by default (--threads changes it for the single-process
    variants), so on a 2-core machine (d) shows what a second process buys. The variants take
    turns, a, b, c, ... then again. Timing, MFU and peak memory come from the trainer's own
    per-step metrics after the warm-up steps (compilation included in the warm-up). With --device
    cuda the runs are bf16 and the memory is rank 0's peak allocated GPU memory (on CPU: the peak
    RSS of the largest process). A variant that fails or runs past --timeout is reported as
    FAILED with the end of its log, and the others still run."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--variants", default=None, help="which to run, e.g. abd (default: abcdef on CPU, abcdfg on CUDA)")
    p.add_argument("--nproc", type=int, default=None, help="processes of d, g, h (default: 2 on CPU, min(2, GPUs))")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per variant and round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=1, help="threads of a single-process variant (1 per rank)")
    p.add_argument("--timeout", type=float, default=0, help="seconds one variant's run may take (0: no limit)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    p.add_argument("--keep_logs", default=None, help="copy each variant's training log into this folder")


# glibc malloc: mmap only above 32 MiB, never trim the heap, the fastest settings measured
# here (a 1 MiB mmap threshold, or a 256 MiB top pad, made steps 20-30% slower).
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
# key: (label, processes: 1, or "N" for torchrun with --nproc, data, extra trainer flags, extra env)
VARIANTS = {
    "a": ("padded jsonl", 1, DEMO_CORPUS, [], {}),
    "b": ("packed bin", 1, DEMO_BIN, [], {}),
    "c": ("packed + compile", 1, DEMO_BIN, ["--use_compile", "1"], {}),
    "d": ("packed, torchrun xN", "N", DEMO_BIN, [], {}),
    "e": ("packed + malloc env", 1, DEMO_BIN, [], MALLOC_TUNING),
    "f": ("packed, no doc_mask", 1, DEMO_BIN, ["--doc_mask", "0"], {}),
    "g": ("packed, FSDP torchrun xN", "N", DEMO_BIN, ["--parallel", "fsdp"], {}),
    "h": ("packed, torchrun xN + compile", "N", DEMO_BIN, ["--use_compile", "1"], {}),
    "i": ("packed + compile, AdamW", 1, DEMO_BIN, ["--use_compile", "1", "--optimizer", "adamw"], {}),
    "j": ("packed + compile, no doc_mask", 1, DEMO_BIN, ["--use_compile", "1", "--doc_mask", "0"], {}),
    "k": ("packed, AdamW", 1, DEMO_BIN, ["--optimizer", "adamw"], {}),
    "m": ("packed, Muon", 1, DEMO_BIN, ["--optimizer", "muon"], {}),
    "n": ("packed, Muon without NorMuon", 1, DEMO_BIN, ["--optimizer", "muon", "--normuon", "0"], {}),
}


def label(key, args) -> str:
    return f"{key}) " + VARIANTS[key][0].replace("xN", f"x{args.nproc}")


def ensure_packed_corpus():
    if not DEMO_CORPUS.exists():
        from dataset.demo_corpus import ensure_demo_corpus

        ensure_demo_corpus(DEMO_CORPUS)
    if not DEMO_BIN.exists():
        launch(["--data_path", DEMO_CORPUS, "--out_path", DEMO_BIN], script=PREPARE, check=True)


def run_variant(key, args, run_dir: Path, results: dict, failures: dict):
    """One run of variant `key`: its timed metrics rows and peak RSS go into results[key], or the
    end of its log into failures[key] (and it does not run again)."""
    if key in failures:
        return
    _, nproc, data, extra, env = VARIANTS[key]
    print(f"running {label(key, args)}", file=sys.stderr, flush=True)
    # Each process takes --batch_size: d trains nproc x the samples per step, as DDP does.
    flags = ["--data_path", data, "--hidden_size", args.hidden_size, "--num_hidden_layers", args.num_hidden_layers,
             "--max_seq_len", args.max_seq_len, "--batch_size", args.batch_size, "--dtype", args.dtype,
             "--max_steps", args.warmup + args.steps, "--log_interval", "1", "--save_interval", "1000000",
             "--val_fraction", "0", "--eval_interval", "0", "--num_workers", "1", *outputs(run_dir),
             *(["--device", "cpu"] if args.device == "cpu" else []), *extra]
    threads = args.threads if nproc == 1 else 1
    run_dir.mkdir(parents=True, exist_ok=True)
    run = launch(flags, nproc=None if nproc == 1 else args.nproc, timeout=args.timeout, log=run_dir / "train.log",
                 env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **env})
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run.log, Path(args.keep_logs) / f"{re.sub(r'[^A-Za-z0-9]+', '_', label(key, args))}.log")
    if run.returncode != 0:
        why = f"timed out after {args.timeout:.0f} s" if run.returncode is None else f"rc {run.returncode}"
        failures[key] = f"{why}\n{run.tail()}"
        return
    results[key]["rows"] += [r for r in metrics(run_dir, args.hidden_size) if r["step"] > args.warmup]
    results[key]["rss"] = max(results[key]["rss"], run.peak_rss_mib)


def summarise(key, rows, rss, args) -> dict:
    nproc = 1 if VARIANTS[key][1] == 1 else args.nproc
    tokens_per_step = args.batch_size * nproc * args.max_seq_len
    seconds = statistics.median(tokens_per_step / r["tokens_per_s"] for r in rows)
    real_fraction = sum(r["nonpad_tokens_per_s"] for r in rows) / sum(r["tokens_per_s"] for r in rows)
    mfus = [r["mfu"] for r in rows if "mfu" in r]
    return {"variant": label(key, args), "processes": nproc, "s_per_step": seconds,
            "tokens_per_s": tokens_per_step / seconds, "nonpad_tokens_per_s": tokens_per_step * real_fraction / seconds,
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_mem_mib": max(r["peak_mem_mib"] for r in rows) if args.device == "cuda" else rss}


def print_throughput(results, failures, args):
    base = next((r for r in results if r["variant"].startswith("a)")), results[0] if results else None)
    table("variant", "s/step", "tokens/s", "non-pad tok/s", "x a (tok)", "x a (non-pad)", "MFU",
          "peak GPU mem" if args.device == "cuda" else "peak RSS")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        row(r["variant"], f"{r['s_per_step']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['nonpad_tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
            f"{r['nonpad_tokens_per_s'] / base['nonpad_tokens_per_s']:.2f}x", mfu, f"{r['peak_mem_mib']:,.0f} MiB")
    for key, why in failures.items():
        print(f"{label(key, args)}: FAILED: {why.splitlines()[0]}")
    for key, why in failures.items():
        print(f"\n--- {label(key, args)}: FAILED, last lines of its log:\n{why}")


def throughput(args):
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_train.py throughput: error: --device cuda: torch sees no CUDA GPU here; use --device cpu")
    args.variants = args.variants or ("abcdfg" if cuda else "abcdef")
    args.nproc = args.nproc or (min(2, torch.cuda.device_count()) if cuda else 2)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    stop_on_sigterm()  # the run in progress is stopped (launch) rather than left holding the GPU
    ensure_packed_corpus()
    results, failures = {key: {"rows": [], "rss": 0.0} for key in args.variants}, {}
    with tempfile.TemporaryDirectory() as work:
        alternate({key: lambda key=key: run_variant(key, args, Path(work) / key, results, failures)
                   for key in args.variants}, args.rounds)
    summary = [summarise(key, r["rows"], r["rss"], args) for key, r in results.items()
               if key not in failures and r["rows"]]
    where = (f"{args.device}: {torch.cuda.get_device_name()}" if cuda
             else f"cpu, {args.threads} thread(s) per single process and 1 per torchrun process")
    print(f"\nhidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.max_seq_len}, batch "
          f"{args.batch_size}/process, {args.dtype}, {where}, median of {args.rounds} x {args.steps} steps after "
          f"{args.warmup} warm-up\n")
    print_throughput(summary, failures, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "run"},
                                             "results": summary, "failed": failures}, indent=2))
    return 1 if failures else 0


# ---------------------------------------------------------------------------- memory
def memory_args(p):
    """Peak memory of a training step with and without --grad_checkpointing; DDP against FSDP.

    Each setting runs in a process of its own (forward, backward, AdamW step: one untimed, two
    timed), so that its peak RSS is its own; on CUDA the peak allocated memory is reported
    instead. --parallel runs train_pretrain.py under torchrun with 2 processes (CPU, gloo) with
    --parallel ddp and fsdp, and reports each rank's share of the state and rank 0's peak RSS."""
    p.add_argument("--hidden_size", type=int, default=512)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--parallel", action="store_true", help="compare DDP and FSDP with 2 processes instead")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # the process of one setting


def memory_child(args):
    """One setting's process: its seconds per step and, on CUDA, its peak allocated memory."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers)
    model = MiniMindForCausalLM(config).to(args.device).train()
    model.model.gradient_checkpointing = bool(args.child)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, config.vocab_size, (args.batch_size, args.max_seq_len), device=args.device)

    def step():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync = (lambda: torch.cuda.synchronize()) if torch.device(args.device).type == "cuda" else None
    result = {"s_per_step": median_seconds(step, rounds=2, warmup=1, sync=sync)}
    if sync:
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print_result(result)


def memory_step(args, checkpointing: int) -> dict:
    run = launch(["memory", "--child", checkpointing, "--hidden_size", args.hidden_size, "--num_hidden_layers",
                  args.num_hidden_layers, "--max_seq_len", args.max_seq_len, "--batch_size", args.batch_size,
                  "--device", args.device], script=Path(__file__))
    return dict(read_result(run), peak_rss_mib=run.peak_rss_mib)


def memory_parallel(args):
    print(f"2 processes (torchrun, CPU/gloo), hidden {args.hidden_size}, {args.num_hidden_layers} layers, "
          f"seq {args.max_seq_len}, batch {args.batch_size}/process, fp32, 3 steps\n")
    table("parallel", "weights/rank", "optimizer state/rank", "peak RSS, rank 0", "incl. saving")
    for mode in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory() as work:
            run = launch(["--parallel", mode, "--hidden_size", args.hidden_size, "--num_hidden_layers",
                          args.num_hidden_layers, "--max_seq_len", args.max_seq_len, "--batch_size", args.batch_size,
                          "--max_steps", "3", "--num_workers", "0", "--val_fraction", "0", "--device", "cpu",
                          "--dtype", "float32", *outputs(Path(work))],
                         nproc=2, env={"OMP_NUM_THREADS": "1"}, check=True)
            state = re.search(r"state per rank: weights ([\d,]+) MiB, optimizer ([\d,]+) MiB", run.output).groups()
            training = max(r["peak_mem_mib"] for r in metrics(Path(work), args.hidden_size))
        row(mode, f"{state[0]} MiB", f"{state[1]} MiB", f"{training:,.0f} MiB", f"{run.peak_rss_mib:,.0f} MiB")


def memory(args):
    if args.child is not None:
        return memory_child(args)
    if args.parallel:
        return memory_parallel(args)
    steps = {"off": memory_step(args, 0), "on": memory_step(args, 1)}
    print(f"hidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.max_seq_len}, "
          f"batch {args.batch_size}, {args.device}, fp32\n")
    key = "cuda_peak_mib" if args.device.startswith("cuda") else "peak_rss_mib"
    table("grad_checkpointing", "peak MiB", "s/step")
    for name, step in steps.items():
        row(name, f"{step[key]:,.0f}", f"{step['s_per_step']:.2f}")
    saved = steps["off"][key] - steps["on"][key]
    print(f"\nsaved {saved:,.0f} MiB ({saved / steps['off'][key]:.0%}) for "
          f"{steps['on']['s_per_step'] / steps['off']['s_per_step']:.2f}x the step time")


SUBCOMMANDS = {"throughput": (throughput_args, throughput), "memory": (memory_args, memory),
               **bench_startup.SUBCOMMANDS}


if __name__ == "__main__":
    args = subcommand_parser(__doc__, SUBCOMMANDS, OneLineArgumentParser).parse_args()
    sys.exit(args.run(args))
