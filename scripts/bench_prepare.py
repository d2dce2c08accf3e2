"""
Tokenizing throughput and memory of prepare_data.py on a sharded JSONL corpus, and the
trainer's start-up time on the shard directory it writes.

    python scripts/bench_prepare.py                  # 1 GB in 8 files, and its first 2 files
    python scripts/bench_prepare.py --file_mb 10     # a quick try
    python scripts/bench_prepare.py --synthetic 8:247000000,1000:247000000   # start-up only

The corpus is dataset/demo_pretrain.jsonl repeated into --num_files files of --file_mb MB
each under --work_dir; everything there is deleted at the end. Each prefix of the files
listed in --sizes is tokenized by its own prepare_data.py process (--num_proc 2 by
default), so its peak RSS is its own: it should not grow with the corpus. Start-up is
the wall time of `train_pretrain.py --max_steps 1` (tiny model, one process) on each
shard directory, next to the same on a single small .bin.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dataset.demo_corpus import DEMO_CORPUS as DEMO  # noqa: E402

PREPARE = REPO_ROOT / "scripts" / "prepare_data.py"
TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--val_fraction", "0", "--max_steps", "1", "--log_interval", "1"]


def make_corpus(folder, num_files, file_mb):
    folder.mkdir(parents=True, exist_ok=True)
    block = DEMO.read_bytes()
    copies = max(1, round(file_mb * 1e6 / len(block)))
    for k in range(num_files):
        with open(folder / f"part-{k:03d}.jsonl", "wb") as f:
            for _ in range(copies):
                f.write(block)
    return sorted(folder.glob("part-*.jsonl"))


def prepare_run(files, work, num_proc):
    """Tokenize `files` (linked into their own folder) with prepare_data.py; its manifest's figures."""
    inputs, out = work / f"in-{len(files)}", work / f"out-{len(files)}"
    inputs.mkdir()
    for f in files:
        (inputs / f.name).symlink_to(f)
    start = time.time()
    subprocess.run([sys.executable, str(PREPARE), "--data_path", str(inputs), "--out_path", str(out),
                    "--num_proc", str(num_proc)], check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - start
    manifest = json.loads((out / "manifest.json").read_text())
    run = manifest["runs"][0]
    mb = sum(f.stat().st_size for f in files) / 1e6
    return out, dict(files=len(files), mb=mb, wall=wall, tokens=manifest["num_tokens"], docs=manifest["num_docs"],
                     bad=run["bad_lines"], tokens_per_s=run["tokens_per_s"],
                     tokens_per_cpu_s=manifest["num_tokens"] / run["cpu_s"], mb_per_s=mb / run["seconds"],
                     main_rss=run["peak_rss_mb"], worker_rss=run["peak_worker_rss_mb"], shards=manifest["num_shards"])


def startup_seconds(data_path, run_dir):
    start = time.time()
    subprocess.run([sys.executable, str(TRAIN), *TINY, "--data_path", str(data_path), "--save_dir",
                    str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt")], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - start


def open_seconds(shard_dir):
    from dataset.shards import ShardedPackedDataset

    start = time.time()
    ds = ShardedPackedDataset(shard_dir, 340)
    ds[len(ds) - 1]
    return time.time() - start


def synthetic_startup(work, num_shards, total_tokens):
    """Start-up on a shard directory of a given size written directly (no tokenizing): what
    the trainer pays at start depends on the shard count and sizes, not on the text."""
    from dataset.packed_dataset import write_meta
    from dataset.shards import write_manifest

    folder = work / f"synthetic-{num_shards}"
    folder.mkdir()
    rng, shards, per = np.random.default_rng(0), [], total_tokens // num_shards
    common = dict(dtype="uint16", vocab_size=6400, bos_token_id=1, eos_token_id=2, tokenizer="synthetic")
    for k in range(num_shards):
        name = f"{k:05d}-synthetic.bin"
        rng.integers(3, 6400, per, dtype=np.uint16).tofile(folder / name)
        write_meta(folder / name, num_tokens=per, num_docs=1, **common)
        shards.append({"path": name, "num_tokens": per, "num_docs": 1})
    write_manifest(folder, common, shards, runs=[])
    row = dict(shards=num_shards, tokens=per * num_shards, startup=startup_seconds(folder, work / f"run-s{num_shards}"),
               opened=open_seconds(folder))
    shutil.rmtree(folder)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--work_dir", default="/tmp/bench_prepare")
    p.add_argument("--num_files", type=int, default=8)
    p.add_argument("--file_mb", type=float, default=125)
    p.add_argument("--sizes", default="2,8", help="how many of the files each prepare run takes")
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--synthetic", default="",
                   help="only time start-up on written shard dirs: SHARDS:TOKENS,... e.g. 8:247000000,1000:247000000")
    args = p.parse_args()
    if args.synthetic:
        work = Path(args.work_dir)
        work.mkdir(parents=True)
        try:
            rows = [synthetic_startup(work, *map(int, spec.split(":"))) for spec in args.synthetic.split(",")]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("| shards | tokens | trainer start-up to step 1 | ShardedPackedDataset open + last window |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['shards']:,} | {r['tokens']:,} | {r['startup']:.1f} s | {r['opened'] * 1e3:.0f} ms |")
        return
    work = Path(args.work_dir)
    if work.exists():
        sys.exit(f"{work} exists; pass another --work_dir or delete it")
    try:
        files = make_corpus(work / "corpus", args.num_files, args.file_mb)
        small = work / "small.bin"
        subprocess.run([sys.executable, str(PREPARE), "--data_path", str(DEMO), "--out_path", str(small),
                        "--num_proc", "1"], check=True, stdout=subprocess.DEVNULL)
        start_small = startup_seconds(small, work / "run-small")
        print(f"start-up on a 1-file .bin: {start_small:.1f} s", flush=True)
        rows = []
        for n in map(int, args.sizes.split(",")):
            out, row = prepare_run(files[:n], work, args.num_proc)
            row.update(startup=startup_seconds(out, work / f"run-{n}"), opened=open_seconds(out))
            rows.append(row)
            print(f"done: {row}", flush=True)  # a row at a time: a slow machine may not get to the end
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nprepare_data.py --num_proc {args.num_proc}, corpus = {DEMO.name} repeated, {args.file_mb:g} MB per file")
    print("| input | files -> shards | tokens | docs | bad lines | wall s | tokens/s | tokens per CPU s | MB/s | peak RSS main | "
          "peak RSS largest worker | trainer start-up | shards open |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["mb"]):
        print(f"| {r['mb']:,.0f} MB | {r['files']} -> {r['shards']} | {r['tokens']:,} | {r['docs']:,} | {r['bad']} | "
              f"{r['wall']:.0f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_cpu_s']:,.0f} | {r['mb_per_s']:.2f} | {r['main_rss']:.0f} MB | "
              f"{r['worker_rss']:.0f} MB | {r['startup']:.1f} s | {r['opened'] * 1e3:.0f} ms |")
    print(f"\ntrainer start-up = wall time of train_pretrain.py --max_steps 1 (python, tiny model) on the shard "
          f"directory; {start_small:.1f} s on a 1-file .bin. shards open = ShardedPackedDataset(dir) + its last window.")


if __name__ == "__main__":
    main()
