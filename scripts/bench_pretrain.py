"""Side-by-side training throughput of the data paths and launch modes.

    python scripts/bench_pretrain.py [--steps 20 --warmup 5 --rounds 2 --out bench.json]

Each variant is a real train_pretrain.py run on the same model and corpus:

    a  padded JSONL (the seed's PretrainDataset)
    b  packed .bin (PackedPretrainDataset)
    c  packed + --use_compile 1
    d  packed, torchrun with 2 processes
    e  packed, with glibc malloc tuned (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_)
    f  packed + --doc_mask 1 (attention kept inside documents: explicit SDPA mask)
    g  packed, torchrun with 2 processes + --use_compile 1 (compiled around DDP)

Every process runs one thread by default (--threads changes it for the single-process
variants), so on a 2-core machine (d) shows what a second process buys. Variants run in rounds, a, b, c, ... then again, so slow and fast
moments of the machine fall on all of them alike. Timing comes from the trainer's
own per-step log rows after the warm-up steps (compilation included in warm-up).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
DEMO_JSONL = REPO_ROOT / "dataset" / "demo_pretrain.jsonl"
DEMO_BIN = REPO_ROOT / "dataset" / "demo_pretrain.bin"
# The best of the glibc settings we tried: mmap only above 32 MiB, never trim the heap.
# (A 1 MiB mmap threshold, or a 256 MiB top pad, made steps 20-30% slower here.)
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
VARIANTS = {
    "a": ("padded jsonl", 1, DEMO_JSONL, [], {}),
    "b": ("packed bin", 1, DEMO_BIN, [], {}),
    "c": ("packed + compile", 1, DEMO_BIN, ["--use_compile", "1"], {}),
    "d": ("packed, torchrun x2", 2, DEMO_BIN, [], {}),
    "e": ("packed + malloc env", 1, DEMO_BIN, [], MALLOC_TUNING),
    "f": ("packed + doc_mask", 1, DEMO_BIN, ["--doc_mask", "1"], {}),
    "g": ("torchrun x2 + compile", 2, DEMO_BIN, ["--use_compile", "1"], {}),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="abcdef", help="which variants to run, e.g. abd")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per variant and round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="threads of each single-process variant (d: 1 per process)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    return p.parse_args()


def ensure_packed_corpus():
    if not DEMO_JSONL.exists():
        from scripts.build_demo_corpus import ensure_demo_corpus

        ensure_demo_corpus(DEMO_JSONL)
    if not DEMO_BIN.exists():
        from scripts.prepare_data import prepare

        prepare(DEMO_JSONL, DEMO_BIN)


def run_variant(key, args, work_dir):
    """One timed run; returns (per-step rows after warm-up, peak RSS in MiB of the largest process)."""
    _, nproc, data, extra, env_extra = VARIANTS[key]
    run_dir = Path(work_dir) / f"{key}"
    # Each process does batch_size; d therefore trains 2x the samples per step, as DDP does.
    flags = ["--data_path", str(data), "--hidden_size", str(args.hidden_size),
             "--num_hidden_layers", str(args.num_hidden_layers), "--max_seq_len", str(args.max_seq_len),
             "--batch_size", str(args.batch_size), "--dtype", args.dtype, "--max_steps", str(args.warmup + args.steps),
             "--log_interval", "1", "--save_interval", "1000000", "--val_fraction", "0", "--eval_interval", "0",
             "--num_workers", "1", "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
             *extra]
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    threads = 1 if nproc > 1 else args.threads
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **env_extra)
    proc = subprocess.Popen([*launcher, str(TRAIN), *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"variant {key} failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "out" / f"pretrain_{args.hidden_size}_metrics.jsonl").open()]
    timed = [r for r in rows if r["kind"] == "train" and r["step"] > args.warmup]
    return timed, usage.ru_maxrss / 1024


def summarise(key, rows, rss, args):
    label, nproc = VARIANTS[key][:2]
    tokens_per_step = args.batch_size * nproc * args.max_seq_len
    seconds = statistics.median(tokens_per_step / r["tokens_per_s"] for r in rows)
    real_fraction = sum(r["nonpad_tokens_per_s"] for r in rows) / sum(r["tokens_per_s"] for r in rows)
    return {"variant": f"{key}) {label}", "processes": nproc, "s_per_step": seconds,
            "tokens_per_s": tokens_per_step / seconds, "nonpad_tokens_per_s": tokens_per_step * real_fraction / seconds,
            "peak_rss_mib": rss}


def print_table(results):
    base = next((r for r in results if r["variant"].startswith("a)")), results[0])
    header = f"{'variant':<26}{'s/step':>9}{'tokens/s':>11}{'non-pad tok/s':>15}{'x a (tok)':>11}{'x a (non-pad)':>15}{'peak RSS':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        r["ratio_tokens"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["ratio_nonpad"] = r["nonpad_tokens_per_s"] / base["nonpad_tokens_per_s"]
        print(f"{r['variant']:<26}{r['s_per_step']:>9.3f}{r['tokens_per_s']:>11,.0f}{r['nonpad_tokens_per_s']:>15,.0f}"
              f"{r['ratio_tokens']:>10.2f}x{r['ratio_nonpad']:>14.2f}x{r['peak_rss_mib']:>8,.0f} MiB")


def main():
    args = parse_args()
    ensure_packed_corpus()
    rows = {k: [] for k in args.variants}
    rss = {k: 0.0 for k in args.variants}
    with tempfile.TemporaryDirectory() as work_dir:
        for round_ in range(args.rounds):
            for key in args.variants:
                print(f"round {round_ + 1}/{args.rounds}: {VARIANTS[key][0]}", file=sys.stderr, flush=True)
                timed, peak = run_variant(key, args, work_dir)
                rows[key] += timed
                rss[key] = max(rss[key], peak)
    results = [summarise(k, rows[k], rss[k], args) for k in args.variants]
    print(f"\nhidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.max_seq_len}, batch {args.batch_size}"
          f"/process, {args.dtype}, {args.threads} thread(s) per single process and 1 per torchrun process, "
          f"median of {args.rounds} x {args.steps} steps\n")
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
