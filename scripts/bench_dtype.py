"""bf16 autocast against fp32 on this CPU: one training step (forward + backward +
fused AdamW) at two model sizes, side by side in one process.

    python scripts/bench_dtype.py                   # 256x4 and 512x8, seq 340, batch 8, 2 threads
    python scripts/bench_dtype.py --shapes 64x2 --steps 2

The dtypes alternate within each shape (fp32, bf16, fp32, bf16, ...) so a machine
shared with other work slows both alike; the table gives the median step time of each
and the ratio. `--dtype auto` turns bf16 on for a CPU only where it has amx_bf16 or
avx512_bf16 (trainer/settings.py); the table says whether this one does.
"""
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402
from trainer.device import native_bf16_cpu_flags, read_cpu_flags  # noqa: E402
from trainer.optim import OptimConfig, build_optimizer  # noqa: E402


def step_timer(hidden, layers, dtype, seq, batch):
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=6400))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    ids = torch.randint(3, 6400, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

    def step() -> float:
        start = time.perf_counter()
        with autocast:
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="256x4,512x8", help="hidden x layers, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="timed steps per dtype")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per dtype first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq", type=int, default=340)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_bf16_cpu_flags(read_cpu_flags())
    print(f"CPU native bf16: {'/'.join(native) or 'no (no amx_bf16/avx512_bf16)'}; torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} threads; seq {args.seq} batch {args.batch}")
    print("| shape | fp32 s/step | bf16 s/step | bf16 speed-up |\n|---|---|---|---|")
    for shape in args.shapes.split(","):
        hidden, layers = (int(v) for v in shape.split("x"))
        steps = {d: step_timer(hidden, layers, d, args.seq, args.batch) for d in ("fp32", "bf16")}
        times = {d: [] for d in steps}
        for i in range(args.steps + args.warmup):
            for dtype, step in steps.items():
                t = step()
                if i >= args.warmup:
                    times[dtype].append(t)
        fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
        print(f"| {hidden}x{layers} | {fp32:.3f} | {bf16:.3f} | {fp32 / bf16:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
