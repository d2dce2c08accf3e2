"""The next-token loss: F.cross_entropy on upcast logits (the model's loss before) against
model/loss.py's chunked cross-entropy, side by side in one run.

    python scripts/bench_loss.py                  # CPU: the table in docs/performance.md
    python scripts/bench_loss.py --device cuda

Each row times the loss's forward and backward on (batch x seq, vocab) logits of the given
dtype, as the trainer makes them (bf16 under autocast, fp32 otherwise), and the gradient's
largest difference between the two; the lm_head's matmul is left out, since both share it.
Runs alternate between the two, so a slow moment of the machine falls on both alike.
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.loss import ChunkedCrossEntropy  # noqa: E402
from trainer.cli import OneLineArgumentParser  # noqa: E402


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--tokens", default="2720,10880", help="comma-separated batch x seq sizes (8 x 340, 32 x 340)")
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args(argv)


def upcast_cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def timed(loss_fn, logits, targets, device) -> tuple[float, torch.Tensor]:
    """(seconds of one forward + backward, the logits' gradient)."""
    leaf = logits.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss_fn(leaf, targets).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, leaf.grad


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    print("| tokens | dtype | F.cross_entropy(logits.float()), ms | chunked, ms | speed-up | max grad diff |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            generator = torch.Generator().manual_seed(0)
            logits = (3 * torch.randn(tokens, args.vocab_size, generator=generator)).to(device, dtype)
            targets = torch.randint(0, args.vocab_size, (tokens,), generator=generator).to(device)
            times = {"full": [], "chunked": []}
            for _ in range(args.repeats + 1):  # the first round warms up and is dropped
                full_s, full_grad = timed(upcast_cross_entropy, logits, targets, device)
                chunked_s, chunked_grad = timed(ChunkedCrossEntropy.apply, logits, targets, device)
                times["full"].append(full_s)
                times["chunked"].append(chunked_s)
            full, chunked = (statistics.median(times[k][1:]) * 1e3 for k in ("full", "chunked"))
            diff = (full_grad.float() - chunked_grad.float()).abs().max().item()
            print(f"| {tokens:,} | {str(dtype).removeprefix('torch.')} | {full:.1f} | {chunked:.1f} | "
                  f"{full / chunked:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
