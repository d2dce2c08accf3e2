"""The next-token loss: F.cross_entropy on upcast logits (the model's loss before) against
model/loss.py's chunked cross-entropy, side by side in one run.

    python scripts/bench_loss.py                  # CPU: the table in docs/performance.md
    python scripts/bench_loss.py --device cuda

Each row times the loss's forward and backward on (batch x seq, vocab) logits of the given
dtype, as the trainer makes them (bf16 under autocast, fp32 otherwise), for each of
--chunk_elements (logits upcast at a time; the device's own, model.loss.chunk_elements, is
marked *), and the largest difference between F.cross_entropy's gradient and any chunked one's;
the lm_head's matmul is left out, since all share it. Runs alternate between them, so a slow
moment of the machine falls on all alike.
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.labels import IGNORE_INDEX  # noqa: E402
from model.loss import ChunkedCrossEntropy, chunk_elements  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--tokens", default="2720,10880", help="comma-separated batch x seq sizes (8 x 340, 32 x 340)")
    p.add_argument("--chunk_elements", default="4194304,262144",
                   help="comma-separated chunk sizes to time (16 MB and 1 MB of fp32)")
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args(argv)


def upcast_cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


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
    sizes = [int(n) for n in args.chunk_elements.split(",")]
    own = chunk_elements(device)
    heads = [f"chunks of {n:,}{' *' if n == own else ''}, ms (speed-up)" for n in sizes]
    print(f"| tokens | dtype | F.cross_entropy(logits.float()), ms | {' | '.join(heads)} | max grad diff |")
    print("|---|---|---|" + "---|" * len(sizes) + "---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            generator = torch.Generator().manual_seed(0)
            logits = (3 * torch.randn(tokens, args.vocab_size, generator=generator)).to(device, dtype)
            targets = torch.randint(0, args.vocab_size, (tokens,), generator=generator).to(device)
            losses = {"full": upcast_cross_entropy}
            losses.update({n: lambda x, t, n=n: ChunkedCrossEntropy.apply(x, t, n) for n in sizes})
            times = {name: [] for name in losses}
            diff = 0.0
            for _ in range(args.repeats + 1):  # the first round warms up and is dropped
                for name, loss_fn in losses.items():
                    seconds, grad = timed(loss_fn, logits, targets, device)
                    times[name].append(seconds)
                    if name == "full":
                        full_grad = grad
                    else:
                        diff = max(diff, (full_grad.float() - grad.float()).abs().max().item())
            ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            cells = " | ".join(f"{ms[n]:.1f} ({ms['full'] / ms[n]:.2f}x)" for n in sizes)
            print(f"| {tokens:,} | {str(dtype).removeprefix('torch.')} | {ms['full']:.1f} | {cells} | {diff:.1e} |")


if __name__ == "__main__":
    main()
