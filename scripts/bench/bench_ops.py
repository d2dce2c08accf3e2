"""Micro-benchmarks of single operations, one subcommand and one table each:

    python scripts/bench/bench_ops.py attention [--device cuda]    # the document mask: dense SDPA, plain matmuls, FlexAttention
    python scripts/bench/bench_ops.py loss [--device cuda]         # F.cross_entropy on upcast logits against model/loss.py
    python scripts/bench/bench_ops.py dtype                        # a training step in bf16 autocast against fp32 (CPU)
    python scripts/bench/bench_ops.py optimizer [--settings cuda]  # Muon's step alone: ours, torch.optim.Muon, AdamW
    python scripts/bench/bench_ops.py ddp [--device cuda]          # what DDP and its settings cost around one step
    python scripts/bench/bench_ops.py checkpoint                   # one save of the trainer, in its parts

`python scripts/bench/bench_ops.py SUBCOMMAND --help` gives each one's flags and what it measures; a
smoke run takes small sizes, e.g. `optimizer --hidden_size 64 --num_hidden_layers 2 --steps 1`.
The variants of a table take turns call by call (scripts/dev/launching.py's alternate), so a slow
moment of the machine falls on all of them alike. optimizer and ddp, which run over several
ranks, are in scripts/bench/bench_ranks.py.
"""
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from common.cli import OneLineArgumentParser  # noqa: E402
from common.labels import IGNORE_INDEX  # noqa: E402
from model.document_mask import dense_document_mask, document_block_mask, document_ids  # noqa: E402
from model.loss import ChunkedCrossEntropy, chunk_elements  # noqa: E402
from model.model_minimind import Attention, MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from scripts.bench import bench_ranks  # noqa: E402
from scripts.dev.launching import alternate, median_seconds, row, subcommand_parser, table  # noqa: E402
from trainer.checkpoint import CheckpointManager  # noqa: E402
from trainer.config import OptimConfig  # noqa: E402
from trainer.device import native_bf16_cpu_flags, read_cpu_flags  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.train_state import ModelState, StepPlan, TrainState  # noqa: E402

BOS = 1
MEAN_DOC_TOKENS = 143  # the demo corpus: 268,432 tokens in 1,874 documents


# ---------------------------------------------------------------------------- what the subcommands share
def build_model(hidden: int, layers: int, device="cpu") -> MiniMindForCausalLM:
    """The model of a benchmark, from the same initial weights every time."""
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=6400)).to(device)


def cuda_sync(device):
    """What the timer calls around each call: CUDA runs asynchronously, the CPU does not."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def median_of(times: dict, name):
    """The median seconds of a variant that alternate() timed, None for one it did not."""
    return statistics.median(times[name]) if name in times else None


def default_dtype(device: str, dtype: str | None) -> torch.dtype:
    """bf16 on CUDA, where the trainer trains in it, fp32 on CPU, unless given."""
    return getattr(torch, dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))


# ---------------------------------------------------------------------------- attention
def attention_args(p):
    """Document-masked attention: SDPA with the dense mask against FlexAttention's BlockMask.

    One attention layer's core (q, k, v already projected: 8 query heads, 4 key/value heads) per
    hidden size and sequence length, through the model's own Attention code: forward alone,
    forward+backward and building the mask, for SDPA with the dense (B,1,T,T) mask, the same mask
    in the model's plain-math path (flash_attn=False: batched matmuls and a softmax, no fused
    kernel), FlexAttention with a BlockMask, and causal SDPA without a document mask (what any
    mask costs). A second table builds the BlockMask from the document boundaries (the trainer's)
    against create_block_mask, which evaluates the mask at every position. Documents have the demo
    corpus's mean length.
    On CPU FlexAttention has no backward (torch raises NotImplementedError): its forward only.
    --check compares the two masks' outputs (and, where FlexAttention has a backward, gradients)."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, else fp32")
    p.add_argument("--hidden_sizes", default="256,512")
    p.add_argument("--seq_lens", default="340,1024")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median)")
    p.add_argument("--mask_batch_sizes", default="4,32", help="batch sizes of the mask-build table")
    p.add_argument("--check", type=int, default=1, choices=[0, 1], help="compare flex and dense outputs/gradients")


def packed_ids(batch, seq_len, device):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 6400, (batch, seq_len), generator=gen)
    ids[torch.rand(batch, seq_len, generator=gen) < 1 / MEAN_DOC_TOKENS] = BOS
    return ids.to(device)


def qkv(attn, batch, seq_len, device, dtype, grad):
    gen = torch.Generator(device=device).manual_seed(1)
    return [torch.randn((batch, heads, seq_len, attn.head_dim), generator=gen, device=device, dtype=dtype)
            .requires_grad_(grad) for heads in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)]


def attention_cell(hidden, seq_len, args, dtype) -> list[dict]:
    """One row per variant: its median seconds forward, forward+backward, and building its mask."""
    attn = Attention(MiniMindConfig(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4))
    # The model's plain-math path (flash_attn=False): batched matmuls and a softmax, no fused kernel.
    matmuls = Attention(MiniMindConfig(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4,
                                       flash_attn=False))
    starts = packed_ids(args.batch_size, seq_len, args.device) == BOS
    masks = {"dense mask SDPA": lambda: dense_document_mask(starts),
             "FlexAttention": lambda: document_block_mask(starts)}
    dense, flex = (make() for make in masks.values())
    attend = {"causal (no doc mask)": lambda q, k, v: attn._attend(q, k, v, None, 0.0, is_causal=True),
              "dense mask SDPA": lambda q, k, v: attn._attend(q, k, v, dense, 0.0, is_causal=False),
              "dense mask, plain matmuls": lambda q, k, v: matmuls._attend(q, k, v, dense, 0.0, is_causal=False),
              "FlexAttention": lambda q, k, v: attn._flex_attend(q, k, v, flex, 0.0)}
    flex_backward = torch.device(args.device).type != "cpu"
    sync = cuda_sync(args.device)
    plain = qkv(attn, args.batch_size, seq_len, args.device, dtype, grad=False)
    leaves = qkv(attn, args.batch_size, seq_len, args.device, dtype, grad=True)
    with torch.no_grad():  # the first, untimed round compiles FlexAttention
        fwd = alternate({name: lambda f=f: f(*plain) for name, f in attend.items()}, args.repeats, 1, sync)
    fwd_bwd = alternate({name: lambda f=f: f(*leaves).float().sum().backward() for name, f in attend.items()
                         if name != "FlexAttention" or flex_backward}, args.repeats, 1, sync)
    build = alternate(masks, args.repeats, 1, sync)
    rows = [dict(variant=name, fwd=median_of(fwd, name), fwd_bwd=median_of(fwd_bwd, name),
                 mask=median_of(build, name)) for name in attend]
    if args.check:
        rows[-1]["check"] = compare_masks(attn, attend, args, seq_len, dtype, flex_backward)
    return rows


def compare_masks(attn, attend, args, seq_len, dtype, with_grads) -> dict:
    """Max abs difference of FlexAttention's output from the dense mask's, and the max relative
    difference of the q, k, v gradients."""
    results = {}
    for name in ("dense mask SDPA", "FlexAttention"):
        q, k, v = qkv(attn, args.batch_size, seq_len, args.device, dtype, grad=with_grads)
        out = attend[name](q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v)) if with_grads else ()
        results[name] = (out.detach().float(), [g.float() for g in grads])
    (dense, dense_grads), (flex, flex_grads) = results.values()
    diff = {"out": (dense - flex).abs().max().item()}
    for label, a, b in zip("qkv", dense_grads, flex_grads):
        diff[f"d{label}"] = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
    return diff


def evaluated_block_mask(ids):
    """The same BlockMask by create_block_mask, which evaluates the mask at all T x T positions."""
    doc = document_ids(ids == BOS)

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])
    return create_block_mask(causal_same_document, ids.shape[0], None, ids.shape[1], ids.shape[1], device=ids.device)


def attention(args):
    dtype = default_dtype(args.device, args.dtype)
    print(f"{args.device}, {str(dtype).removeprefix('torch.')}, batch {args.batch_size}, 8 query / 4 KV heads, "
          f"documents of {MEAN_DOC_TOKENS} tokens on average, median of {args.repeats} calls, ms per layer")
    table("hidden", "seq", "variant", "fwd", "fwd+bwd", "mask", "x dense")
    checks = []
    for hidden in map(int, args.hidden_sizes.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            rows = attention_cell(hidden, seq_len, args, dtype)
            dense = next(r for r in rows if r["variant"] == "dense mask SDPA")
            for r in rows:
                key = "fwd_bwd" if r["fwd_bwd"] is not None else "fwd"  # FlexAttention on CPU: forward only
                row(hidden, seq_len, r["variant"], ms(r["fwd"]), ms(r["fwd_bwd"]), ms(r["mask"]),
                    f"{dense[key] / r[key]:.2f}x")
            checks += [(hidden, seq_len, r["check"]) for r in rows if "check" in r]
    print("\nx dense: the dense-mask row's time over this row's (fwd+bwd where both have it, else fwd)")
    if checks:
        print("FlexAttention vs dense mask, max abs diff of the output (and max relative diff of dq, dk, dv):")
        for hidden, seq_len, diff in checks:
            print(f"  hidden {hidden} seq {seq_len}: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    mask_builds(args)


def mask_builds(args):
    """The second table: each way of building the mask once."""
    builders = {"dense (B,1,T,T)": lambda ids: dense_document_mask(ids == BOS),
                "BlockMask from boundaries": lambda ids: document_block_mask(ids == BOS),
                "create_block_mask": evaluated_block_mask}
    print(f"\nbuilding the mask once, ms (median of {args.repeats})\n")
    table("batch", "seq", *builders)
    for batch in map(int, args.mask_batch_sizes.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            ids = packed_ids(batch, seq_len, args.device)
            times = alternate({name: lambda b=b: b(ids) for name, b in builders.items()}, args.repeats, 1,
                              cuda_sync(args.device))
            row(batch, seq_len, *(ms(median_of(times, name)) for name in builders))


# ---------------------------------------------------------------------------- loss
def loss_args(p):
    """The next-token loss: F.cross_entropy on upcast logits against model/loss.py's chunks.

    The loss's forward and backward on (batch x seq, vocab) logits of the dtype the trainer makes
    them in (bf16 under autocast, fp32 otherwise): F.cross_entropy on upcast logits (the model's
    loss before) against the chunked cross-entropy for each of --chunk_elements (logits upcast at a
    time; the device's own, model.loss.chunk_elements, is marked *), and the largest difference of
    any chunked gradient from F.cross_entropy's. The lm_head's matmul is left out: all share it."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--tokens", default="2720,10880", help="comma-separated batch x seq sizes (8 x 340, 32 x 340)")
    p.add_argument("--chunk_elements", default="4194304,262144",
                   help="comma-separated chunk sizes to time (16 MB and 1 MB of fp32)")
    p.add_argument("--repeats", type=int, default=10)


def upcast_cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def logits_grad(loss_fn, logits, targets) -> torch.Tensor:
    leaf = logits.detach().requires_grad_()
    loss_fn(leaf, targets).backward()
    return leaf.grad


def loss(args):
    device = torch.device(args.device)
    sizes, own = [int(n) for n in args.chunk_elements.split(",")], chunk_elements(device)
    table("tokens", "dtype", "F.cross_entropy(logits.float()), ms",
          *(f"chunks of {n:,}{' *' if n == own else ''}, ms (speed-up)" for n in sizes), "max grad diff")
    for tokens in map(int, args.tokens.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            generator = torch.Generator().manual_seed(0)
            logits = (3 * torch.randn(tokens, args.vocab_size, generator=generator)).to(device, dtype)
            targets = torch.randint(0, args.vocab_size, (tokens,), generator=generator).to(device)
            losses = {"full": upcast_cross_entropy,
                      **{n: lambda x, t, n=n: ChunkedCrossEntropy.apply(x, t, n) for n in sizes}}
            times = alternate({name: lambda f=f: logits_grad(f, logits, targets) for name, f in losses.items()},
                              args.repeats, 1, cuda_sync(device))
            full = median_of(times, "full")
            full_grad = logits_grad(upcast_cross_entropy, logits, targets).float()
            diff = max((full_grad - logits_grad(losses[n], logits, targets).float()).abs().max().item() for n in sizes)
            chunked = [median_of(times, n) for n in sizes]
            row(f"{tokens:,}", str(dtype).removeprefix("torch."), ms(full),
                *(f"{ms(t)} ({full / t:.2f}x)" for t in chunked), f"{diff:.1e}")


# ---------------------------------------------------------------------------- dtype
def dtype_args(p):
    """bf16 autocast against fp32 on this CPU, one training step at a few model sizes.

    One training step (forward + backward + fused AdamW), the dtypes taking turns.
    `--dtype auto` turns bf16 on for a CPU only where it has amx_bf16 or avx512_bf16
    (trainer/device.py); the table says whether this one does."""
    p.add_argument("--shapes", default="256x4,512x8", help="hidden x layers, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="timed steps per dtype")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per dtype first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq", type=int, default=340)
    p.add_argument("--batch", type=int, default=8)


def training_step(hidden, layers, autocast, seq, batch):
    model = build_model(hidden, layers)
    # The fused AdamW, at the weight decay and betas auto gives it.
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3, optimizer="adamw", weight_decay=0.01,
                                                   adam_betas=(0.9, 0.95)))
    ids = torch.randint(3, 6400, (batch, seq))

    def step():
        with autocast:
            model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def dtype(args):
    torch.set_num_threads(args.threads)
    native = native_bf16_cpu_flags(read_cpu_flags())
    print(f"CPU native bf16: {'/'.join(native) or 'no (no amx_bf16/avx512_bf16)'}; torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} threads; seq {args.seq} batch {args.batch}")
    table("shape", "fp32 s/step", "bf16 s/step", "bf16 speed-up")
    for shape in args.shapes.split(","):
        hidden, layers = map(int, shape.split("x"))
        autocasts = {"fp32": nullcontext(), "bf16": torch.autocast("cpu", dtype=torch.bfloat16)}
        steps = {name: training_step(hidden, layers, autocast, args.seq, args.batch)
                 for name, autocast in autocasts.items()}
        times = alternate(steps, args.steps, args.warmup)
        fp32, bf16 = (median_of(times, name) for name in steps)
        row(f"{hidden}x{layers}", f"{fp32:.3f}", f"{bf16:.3f}", f"{fp32 / bf16:.2f}x")


# ---------------------------------------------------------------------------- checkpoint
def checkpoint_args(p):
    """How long one save of the trainer takes (CPU, one process).

    A save is what train_pretrain.py does at --save_interval (trainer/checkpoint.py's
    CheckpointManager.save): the finiteness check of the weights, the half-precision .pth for
    inference, the resume checkpoint of fp32 weights and AdamW state, its sha256 record and the
    `latest` link. Rank 0's cost, which every other rank waits for. It times this tree's code
    only: to compare a revision that has this script, run the same command in a checkout of it
    (git worktree add), the two taking turns a few times."""
    p.add_argument("--repeats", type=int, default=4, help="timed saves (median), after one untimed")
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")


def checkpoint(args):
    model = build_model(args.hidden_size, args.num_hidden_layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one update, so that AdamW holds its two moments per parameter
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    weights, state = ModelState(model, optimizer), TrainState(StepPlan(8, 1, 1, 10**6, 10**6))
    with tempfile.TemporaryDirectory(dir=args.dir) as out:
        weights_path = Path(out) / f"bench_{args.hidden_size}.pth"
        manager = CheckpointManager(str(Path(out) / "ckpt"), "bench", model.config.to_dict(), weights,
                                    {"train_state": state}, keep_last=1, weights_path=str(weights_path))

        def save():
            state.global_step += 1
            state.tokens_seen += 1000
            return manager.save(state.global_step)
        finite = median_seconds(weights.finite, args.repeats)
        wall = median_seconds(save, args.repeats)
        cpu = median_seconds(save, args.repeats, clock=time.process_time)
        sizes = weights_path.stat().st_size / 1e6, Path(save()).stat().st_size / 1e6
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f}M parameters (hidden {args.hidden_size}, {args.num_hidden_layers} layers), CPU, "
          f"median of {args.repeats} saves; weights {sizes[0]:.0f} MB, resume checkpoint {sizes[1]:.0f} MB")
    table("part of a save", "seconds")
    row("finiteness check", f"{finite:.3f}")
    row("**the whole save** (wall: finiteness check, fp16 weights, resume checkpoint, record, link)", f"{wall:.3f}")
    row("the whole save, CPU time of the process", f"{cpu:.3f}")


SUBCOMMANDS = {"attention": (attention_args, attention), "loss": (loss_args, loss), "dtype": (dtype_args, dtype),
               **bench_ranks.SUBCOMMANDS, "checkpoint": (checkpoint_args, checkpoint)}


if __name__ == "__main__":
    args = subcommand_parser(__doc__, SUBCOMMANDS, OneLineArgumentParser).parse_args()
    args.run(args)
