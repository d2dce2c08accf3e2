"""How long one save takes in the trainer, before and after a change, side by side.

A save is what train_pretrain.py does at --save_interval: the finiteness check of the
weights, the half-precision .pth for inference, and the resume checkpoint (fp32
weights + AdamW state, its sha256 record, the `latest` link). Each code version runs
in its own process, with its own copy of common/, trainer/, model/ and dataset/ (`--before`
is exported from git), on the same model and the same disk:

    python scripts/bench_checkpoint.py                          # 64M model, before = main
    python scripts/bench_checkpoint.py --before HEAD~3 --rounds 3
    python scripts/bench_checkpoint.py --hidden_size 64 --num_hidden_layers 2 --rounds 1   # smoke test

One process on CPU, no process group: the cost measured is rank 0's, which is what
every other rank waits for. The worker drives trainer/checkpoint.py's CheckpointManager,
so --before takes revisions that have it (the tables of earlier revisions were measured
with their own version of this script).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = ("finite", "weights", "checkpoint", "total")


def worker(tree: str, args):
    """Time `args.repeats` saves with the code in `tree`; print one JSON line of medians."""
    sys.path.insert(0, tree)
    import torch

    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from trainer.checkpoint import CheckpointManager
    from trainer.train_state import ModelState
    from trainer.train_state import StepPlan, TrainState

    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, vocab_size=6400)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one update, so AdamW holds its two moments per parameter
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weights = ModelState(model, optimizer)

    with tempfile.TemporaryDirectory(dir=args.dir) as out:
        prefix = f"bench_{args.hidden_size}"
        weights_path = os.path.join(out, "out", f"{prefix}.pth")
        times = {part: [] for part in PARTS}
        cpu_seconds = []
        for step in range(1, args.repeats + 1):
            state = TrainState(StepPlan(8, 1, 1, 10**6, 10**6), global_step=step, tokens_seen=step * 1000)
            manager = CheckpointManager(os.path.join(out, "ckpt"), prefix, config.to_dict(), weights,
                                        {"train_state": state}, keep_last=1)
            c0, t0 = time.process_time(), time.perf_counter()
            assert weights.finite()
            t1 = time.perf_counter()
            weights.export(weights_path)
            t2 = time.perf_counter()
            path = manager.save(step)  # checks finiteness again: counted once, below
            t3, c3 = time.perf_counter(), time.process_time()
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2 - (t1 - t0), t3 - t0 - (t1 - t0))):
                times[part].append(seconds)
            cpu_seconds.append(c3 - c0)
        sizes = {"weights_mb": os.path.getsize(weights_path) / 1e6, "checkpoint_mb": os.path.getsize(path) / 1e6}
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params, **sizes, **times, "cpu": cpu_seconds}))


def export(ref: str, dest: Path) -> Path:
    """common/, trainer/, model/ and dataset/ as of git `ref`, unpacked into dest."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, "common", "trainer", "model", "dataset"],
                             check=True, capture_output=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_worker(tree: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(tree), "--repeats", str(args.repeats),
           "--hidden_size", str(args.hidden_size), "--num_hidden_layers", str(args.num_hidden_layers)]
    if args.dir:
        cmd += ["--dir", args.dir]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="main", help="git ref of the code to compare against")
    p.add_argument("--repeats", type=int, default=2, help="saves per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per version, taking turns; medians are reported")
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args)

    # The versions take turns, round after round, so a machine that gets busier or
    # quieter in between weighs on both alike.
    samples = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export(args.before, Path(tmp) / "before"), "after": REPO_ROOT}
        for _ in range(args.rounds):
            for version, tree in trees.items():
                samples[version].append(run_worker(tree, args))
    med = {version: {key: statistics.median(t for run in runs for t in run[key]) for key in (*PARTS, "cpu")}
           for version, runs in samples.items()}
    last = samples["after"][-1]
    print(f"{last['params'] / 1e6:.1f}M parameters (hidden {args.hidden_size}, {args.num_hidden_layers} layers), "
          f"CPU, median of {args.rounds} x {args.repeats} saves per version; weights {last['weights_mb']:.0f} MB, "
          f"resume checkpoint {last['checkpoint_mb']:.0f} MB")
    print(f"| part of a save | before ({args.before}) | after (this tree) | after / before |")
    print("|---|---|---|---|")
    names = {"finite": "finiteness check", "weights": "fp16 weights .pth", "checkpoint": "resume checkpoint + record",
             "total": "**total (wall)**", "cpu": "total CPU time of the process"}
    for key in (*PARTS, "cpu"):
        before, after = med["before"][key], med["after"][key]
        ratio = after / before if before else float("nan")
        print(f"| {names[key]} | {before:.3f} s | {after:.3f} s | {ratio:.2f} |")


if __name__ == "__main__":
    main()
