"""Side-by-side training throughput of the data paths and launch modes.

    python scripts/bench_pretrain.py [--steps 20 --warmup 5 --rounds 2 --out bench.json]
    python scripts/bench_pretrain.py --device cuda [--hidden_size 768 --num_hidden_layers 8 --max_seq_len 1024]

Each variant is a real train_pretrain.py run on the same model and corpus:

    a  padded JSONL (MiniMind's PretrainDataset)
    b  packed .bin (PackedPretrainDataset)
    c  packed + --use_compile 1
    d  packed, torchrun with N processes (DDP; N = 2 on CPU, min(2, GPUs) on CUDA)
    e  packed, with glibc malloc tuned (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_)
    f  packed + --doc_mask 1 (attention kept inside documents: dense mask on CPU, FlexAttention on CUDA)
    g  packed, torchrun with N processes and --parallel fsdp
    h  packed, torchrun with N processes + --use_compile 1 (compiled around DDP)
    i  packed + --use_compile 1 --optimizer adamw (beside c: what Muon costs)
    j  packed + --use_compile 1 --doc_mask 1 (beside c: what the document mask costs)
    k  packed + --optimizer adamw (beside m: what Muon costs)
    m  packed + --optimizer muon (b's optimizer wherever --optimizer auto takes Muon)

Every process runs one thread by default (--threads changes it for the single-process
variants), so on a 2-core machine (d) shows what a second process buys. Variants run in
rounds, a, b, c, ... then again, so slow and fast moments of the machine fall on all of
them alike. Timing, MFU and peak memory come from the trainer's own per-step metrics rows
after the warm-up steps (compilation included in warm-up). With --device cuda the runs are
bf16 and the memory column is rank 0's peak allocated GPU memory (on CPU: peak RSS of the
largest process). A variant that fails or runs past --timeout is reported as FAILED with the
end of its log, and the others still run.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dataset.demo_corpus import DEMO_CORPUS as DEMO_JSONL  # noqa: E402
from trainer.config import run_prefix  # noqa: E402

TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
DEMO_BIN = DEMO_JSONL.with_suffix(".bin")
# glibc malloc: mmap only above 32 MiB, never trim the heap, the fastest settings measured
# here (a 1 MiB mmap threshold, or a 256 MiB top pad, made steps 20-30% slower).
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
# key: (label, processes ("N": the --nproc flag), data, extra trainer flags, extra env)
VARIANTS = {
    "a": ("padded jsonl", 1, DEMO_JSONL, [], {}),
    "b": ("packed bin", 1, DEMO_BIN, [], {}),
    "c": ("packed + compile", 1, DEMO_BIN, ["--use_compile", "1"], {}),
    "d": ("packed, torchrun xN", "N", DEMO_BIN, [], {}),
    "e": ("packed + malloc env", 1, DEMO_BIN, [], MALLOC_TUNING),
    "f": ("packed + doc_mask", 1, DEMO_BIN, ["--doc_mask", "1"], {}),
    "g": ("packed, FSDP torchrun xN", "N", DEMO_BIN, ["--parallel", "fsdp"], {}),
    "h": ("packed, torchrun xN + compile", "N", DEMO_BIN, ["--use_compile", "1"], {}),
    "i": ("packed + compile, AdamW", 1, DEMO_BIN, ["--use_compile", "1", "--optimizer", "adamw"], {}),
    "j": ("packed + compile + doc_mask", 1, DEMO_BIN, ["--use_compile", "1", "--doc_mask", "1"], {}),
    "k": ("packed, AdamW", 1, DEMO_BIN, ["--optimizer", "adamw"], {}),
    "m": ("packed, Muon", 1, DEMO_BIN, ["--optimizer", "muon"], {}),
    "n": ("packed, Muon without NorMuon", 1, DEMO_BIN, ["--optimizer", "muon", "--normuon", "0"], {}),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--variants", default=None, help="which variants to run, e.g. abd (default: abcdef on CPU, abcdfg on CUDA)")
    p.add_argument("--nproc", type=int, default=None, help="processes of d and g (default: 2 on CPU, min(2, GPUs) on CUDA)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per variant and round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=1, help="threads of each single-process variant (d: 1 per process)")
    p.add_argument("--timeout", type=float, default=0, help="seconds one variant run may take (0: no limit)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    p.add_argument("--keep_logs", default=None, help="copy each variant's training log into this folder")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    return argparse.Namespace(**{
        **vars(args),
        "variants": args.variants or ("abcdfg" if cuda else "abcdef"),
        "nproc": args.nproc or (min(2, torch.cuda.device_count()) if cuda else 2),
        "dtype": args.dtype or ("bfloat16" if cuda else "float32"),
    })


def processes(key, args):
    nproc = VARIANTS[key][1]
    return args.nproc if nproc == "N" else nproc


def label(key, args):
    return VARIANTS[key][0].replace("xN", f"x{args.nproc}")


def ensure_packed_corpus():
    if not DEMO_JSONL.exists():
        from dataset.demo_corpus import ensure_demo_corpus

        ensure_demo_corpus(DEMO_JSONL)
    if not DEMO_BIN.exists():
        from scripts.prepare_data import prepare

        prepare(DEMO_JSONL, DEMO_BIN)


def run_variant(key, args, work_dir):
    """One timed run; returns (per-step rows after warm-up, peak RSS in MiB of the largest
    process), or raises VariantFailed with the end of its log."""
    _, _, data, extra, env_extra = VARIANTS[key]
    nproc = processes(key, args)
    run_dir = Path(work_dir) / f"{key}"
    # Each process does batch_size; d therefore trains nproc x the samples per step, as DDP does.
    flags = ["--data_path", str(data), "--hidden_size", str(args.hidden_size),
             "--num_hidden_layers", str(args.num_hidden_layers), "--max_seq_len", str(args.max_seq_len),
             "--batch_size", str(args.batch_size), "--dtype", args.dtype, "--max_steps", str(args.warmup + args.steps),
             "--log_interval", "1", "--save_interval", "1000000", "--val_fraction", "0", "--eval_interval", "0",
             "--num_workers", "1", "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
             *(["--device", "cpu"] if args.device == "cpu" else []), *extra]
    launcher = [sys.executable] if VARIANTS[key][1] == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    threads = 1 if nproc > 1 else args.threads
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **env_extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*launcher, str(TRAIN), *flags], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        exit_code, usage = wait_with_usage(proc, args.timeout)
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, Path(args.keep_logs) / f"{key}_{re.sub(r'[^A-Za-z0-9]+', '_', label(key, args))}.log")
    if exit_code != 0:
        why = f"timed out after {args.timeout:.0f} s" if exit_code is None else f"rc {exit_code}"
        raise VariantFailed(f"{why}\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]))
    metrics = run_dir / "out" / f"{run_prefix('pretrain', args.hidden_size, False)}_metrics.jsonl"
    rows = [json.loads(line) for line in metrics.open()]
    timed = [r for r in rows if r["kind"] == "train" and r["step"] > args.warmup]
    return timed, usage.ru_maxrss / 1024


class VariantFailed(Exception):
    pass


def wait_with_usage(proc, timeout):
    """(exit code, resource usage) of proc; past timeout seconds it is stopped and the exit
    code is None."""
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status), usage
            if deadline and time.monotonic() > deadline:
                stop(proc)
                return None, os.wait4(proc.pid, 0)[2]
            time.sleep(0.2)
    except KeyboardInterrupt:  # its own session does not get our Ctrl-C
        stop(proc)
        raise


def stop(proc, grace=15):
    """SIGTERM first: torchrun starts its workers in sessions of their own and only passes a
    SIGTERM on to them (a SIGKILL would leave them running, holding the GPU)."""
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)


def summarise(key, rows, rss, args):
    nproc = processes(key, args)
    tokens_per_step = args.batch_size * nproc * args.max_seq_len
    seconds = statistics.median(tokens_per_step / r["tokens_per_s"] for r in rows)
    real_fraction = sum(r["nonpad_tokens_per_s"] for r in rows) / sum(r["tokens_per_s"] for r in rows)
    mfus = [r["mfu"] for r in rows if "mfu" in r]
    memory = max(r["peak_mem_mib"] for r in rows) if args.device == "cuda" else rss
    return {"variant": f"{key}) {label(key, args)}", "processes": nproc, "s_per_step": seconds,
            "tokens_per_s": tokens_per_step / seconds, "nonpad_tokens_per_s": tokens_per_step * real_fraction / seconds,
            "mfu": statistics.median(mfus) if mfus else None, "peak_mem_mib": memory}


def print_table(results, failures, args):
    base = next((r for r in results if r["variant"].startswith("a)")), results[0] if results else None)
    memory = "peak GPU mem" if args.device == "cuda" else "peak RSS"
    header = (f"{'variant':<28}{'s/step':>9}{'tokens/s':>12}{'non-pad tok/s':>15}{'x a (tok)':>11}{'x a (non-pad)':>15}"
              f"{'MFU':>8}{memory:>15}")
    print(header)
    print("-" * len(header))
    for r in results:
        r["ratio_tokens"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["ratio_nonpad"] = r["nonpad_tokens_per_s"] / base["nonpad_tokens_per_s"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['variant']:<28}{r['s_per_step']:>9.3f}{r['tokens_per_s']:>12,.0f}{r['nonpad_tokens_per_s']:>15,.0f}"
              f"{r['ratio_tokens']:>10.2f}x{r['ratio_nonpad']:>14.2f}x{mfu:>8}{r['peak_mem_mib']:>11,.0f} MiB")
    for key, why in failures.items():
        print(f"{key}) {label(key, args):<25}FAILED: {why.splitlines()[0]}")
    for key, why in failures.items():
        print(f"\n--- {key}) {label(key, args)}: FAILED, last lines of its log:\n{why}")


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    args = parse_args()
    # timeout(1) and schedulers stop us with SIGTERM: the runs, in sessions of their own, are
    # stopped first (wait_with_usage), so none is left holding the GPU.
    signal.signal(signal.SIGTERM, interrupted)
    ensure_packed_corpus()
    rows = {k: [] for k in args.variants}
    rss = {k: 0.0 for k in args.variants}
    failures = {}
    with tempfile.TemporaryDirectory() as work_dir:
        for round_ in range(args.rounds):
            for key in args.variants:
                if key in failures:
                    continue
                print(f"round {round_ + 1}/{args.rounds}: {label(key, args)}", file=sys.stderr, flush=True)
                try:
                    timed, peak = run_variant(key, args, work_dir)
                except VariantFailed as exc:
                    failures[key] = str(exc)
                    continue
                rows[key] += timed
                rss[key] = max(rss[key], peak)
    results = [summarise(k, rows[k], rss[k], args) for k in args.variants if k not in failures and rows[k]]
    where = (f"{args.device}: {torch.cuda.get_device_name()}" if args.device == "cuda"
             else f"cpu, {args.threads} thread(s) per single process and 1 per torchrun process")
    print(f"\nhidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.max_seq_len}, batch {args.batch_size}"
          f"/process, {args.dtype}, {where}, median of {args.rounds} x {args.steps} steps after {args.warmup} warm-up\n")
    print_table(results, failures, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "results": results, "failed": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
