"""Peak memory: one training step with and without --grad_checkpointing, and a
2-process run under DDP and under FSDP.

    python scripts/bench_memory.py [--hidden_size 512 --num_hidden_layers 8 --max_seq_len 1024 --batch_size 4]
    python scripts/bench_memory.py --parallel [--hidden_size 768 --num_hidden_layers 8]

Each mode runs in a fresh process (forward, backward, AdamW step, twice) so its
peak RSS is its own; on CUDA the peak allocated memory is reported instead. The
--parallel table runs train_pretrain.py under torchrun (CPU, gloo) and reports the
largest worker's peak RSS.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from trainer.config import run_prefix  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden_size", type=int, default=512)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--parallel", action="store_true", help="compare DDP and FSDP with 2 processes instead")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def one_step(args):
    """Runs in the child: report seconds per step and the CUDA peak (if any) as JSON."""
    import torch

    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers)
    model = MiniMindForCausalLM(config).to(args.device).train()
    model.model.gradient_checkpointing = bool(args.child)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, config.vocab_size, (args.batch_size, args.max_seq_len), device=args.device)
    start = time.time()
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result = {"s_per_step": (time.time() - start) / 2}
    if torch.device(args.device).type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


def measure(args, checkpointing: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(checkpointing), "--hidden_size", str(args.hidden_size),
           "--num_hidden_layers", str(args.num_hidden_layers), "--max_seq_len", str(args.max_seq_len),
           "--batch_size", str(args.batch_size), "--device", args.device]
    output, rss = run_measured(cmd)
    return dict(json.loads(output.strip().splitlines()[-1]), peak_rss_mib=rss)


def run_measured(cmd, env=None) -> tuple[str, float]:
    """Run to completion: (stdout, peak RSS in MiB of the largest process it or its children ran)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"run failed:\n{output[-3000:]}")
    return output, usage.ru_maxrss / 1024


def compare_parallel(args):
    import tempfile

    print(f"2 processes (torchrun, CPU/gloo), hidden {args.hidden_size}, {args.num_hidden_layers} layers, "
          f"seq {args.max_seq_len}, batch {args.batch_size}/process, fp32, 3 steps\n")
    print(f"{'parallel':<10}{'weights/rank':>16}{'AdamW/rank':>18}{'peak RSS, rank 0':>22}{'incl. saving':>22}")
    for mode in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory() as work:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   str(REPO_ROOT / "trainer" / "train_pretrain.py"), "--parallel", mode,
                   "--hidden_size", str(args.hidden_size), "--num_hidden_layers", str(args.num_hidden_layers),
                   "--max_seq_len", str(args.max_seq_len), "--batch_size", str(args.batch_size), "--max_steps", "3",
                   "--num_workers", "0", "--val_fraction", "0", "--save_dir", f"{work}/out",
                   "--checkpoint_dir", f"{work}/ckpt"]
            output, rss = run_measured(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
            state = re.search(r"state per rank: weights ([\d,]+) MiB, optimizer ([\d,]+) MiB", output).groups()
            metrics = f"{work}/out/{run_prefix('pretrain', args.hidden_size, False)}_metrics.jsonl"
            rows = [json.loads(line) for line in open(metrics)]
            training = max(r["peak_mem_mib"] for r in rows if r["kind"] == "train")
        print(f"{mode:<10}{state[0]:>12} MiB{state[1]:>14} MiB{training:>18,.0f} MiB{rss:>18,.0f} MiB")


def main():
    args = parse_args()
    if args.child is not None:
        return one_step(args)
    if args.parallel:
        return compare_parallel(args)
    rows = {"off": measure(args, 0), "on": measure(args, 1)}
    print(f"hidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.max_seq_len}, "
          f"batch {args.batch_size}, {args.device}, fp32\n")
    key = "cuda_peak_mib" if args.device.startswith("cuda") else "peak_rss_mib"
    print(f"{'grad_checkpointing':<20}{'peak MiB':>10}{'s/step':>9}")
    for name, row in rows.items():
        print(f"{name:<20}{row[key]:>10,.0f}{row['s_per_step']:>9.2f}")
    saved = rows["off"][key] - rows["on"][key]
    print(f"\nsaved {saved:,.0f} MiB ({saved / rows['off'][key]:.0%}) for "
          f"{rows['on']['s_per_step'] / rows['off']['s_per_step']:.2f}x the step time")


if __name__ == "__main__":
    main()
