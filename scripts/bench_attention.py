"""Document-masked attention: SDPA with the dense (B,1,T,T) mask against FlexAttention's
BlockMask, through the model's own Attention code, side by side in one run.

    python scripts/bench_attention.py                    # CPU, fp32: the table in the README
    python scripts/bench_attention.py --device cuda      # bf16; also checks outputs and gradients

Each row times one attention layer's core (q, k, v already projected: 8 query heads,
4 key/value heads) at a given hidden size and sequence length, forward alone and
forward+backward, plus the cost of building the mask once; a second table times the
BlockMask read off the document boundaries (the trainer's) against create_block_mask, which
evaluates the mask at every position (what the trainer did before). Documents are drawn with the demo
corpus's mean length (143 tokens). Causal SDPA without any document mask is the
reference for what a mask costs. On CPU FlexAttention has no backward (torch raises
NotImplementedError), so only its forward is timed there; --check compares the two masks'
outputs (and, where FlexAttention has a backward, their gradients).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from model.document_mask import dense_document_mask, document_block_mask, document_ids  # noqa: E402
from model.model_minimind import Attention, MiniMindConfig  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402

BOS = 1
MEAN_DOC_TOKENS = 143  # demo corpus: 268,432 tokens in 1,874 documents


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--hidden_sizes", default="256,512")
    p.add_argument("--seq_lens", default="340,1024")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median)")
    p.add_argument("--mask_batch_sizes", default="4,32", help="batch sizes of the mask-build table")
    p.add_argument("--check", type=int, default=1, choices=[0, 1], help="compare flex and dense outputs/gradients")
    return p.parse_args(argv)


def packed_ids(batch, seq_len, device):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 6400, (batch, seq_len), generator=gen)
    ids[torch.rand(batch, seq_len, generator=gen) < 1 / MEAN_DOC_TOKENS] = BOS
    return ids.to(device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, repeats):
    fn()  # warm-up: compiles FlexAttention on first use
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def inputs(attn, batch, seq_len, device, dtype, grad):
    gen = torch.Generator(device=device).manual_seed(1)
    shape = lambda heads: (batch, heads, seq_len, attn.head_dim)  # noqa: E731
    return [torch.randn(shape(h), generator=gen, device=device, dtype=dtype).requires_grad_(grad)
            for h in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)]


def run_cell(hidden, seq_len, args, dtype):
    device = args.device
    attn = Attention(MiniMindConfig(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4))
    ids = packed_ids(args.batch_size, seq_len, device)
    masks = {"dense": lambda: dense_document_mask(ids == BOS), "flex": lambda: document_block_mask(ids == BOS)}
    built = {name: make() for name, make in masks.items()}
    calls = {
        "causal (no doc mask)": lambda q, k, v: attn._attend(q, k, v, None, 0.0, is_causal=True),
        "dense mask SDPA": lambda q, k, v: attn._attend(q, k, v, built["dense"], 0.0, is_causal=False),
        "FlexAttention": lambda q, k, v: attn._flex_attend(q, k, v, built["flex"], 0.0),
    }
    flex_backward = not device.startswith("cpu")
    rows = []
    for name, call in calls.items():
        q, k, v = inputs(attn, args.batch_size, seq_len, device, dtype, grad=False)
        with torch.no_grad():
            fwd = median_ms(lambda: call(q, k, v), device, args.repeats)
        fwd_bwd = None
        if name != "FlexAttention" or flex_backward:
            q, k, v = inputs(attn, args.batch_size, seq_len, device, dtype, grad=True)
            fwd_bwd = median_ms(lambda: call(q, k, v).float().sum().backward(), device, args.repeats)
        mask_key = {"dense mask SDPA": "dense", "FlexAttention": "flex"}.get(name)
        mask_ms = median_ms(masks[mask_key], device, args.repeats) if mask_key else None
        rows.append(dict(hidden=hidden, seq=seq_len, variant=name, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, mask_ms=mask_ms))
    if args.check:
        rows[-1]["check"] = compare(attn, calls, args, seq_len, dtype, flex_backward)
    return rows


def compare(attn, calls, args, seq_len, dtype, with_grads):
    """Max abs difference of FlexAttention against the dense mask: output, and q/k/v gradients."""
    results = {}
    for name in ("dense mask SDPA", "FlexAttention"):
        q, k, v = inputs(attn, args.batch_size, seq_len, args.device, dtype, grad=with_grads)
        out = calls[name](q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v)) if with_grads else ()
        results[name] = (out.detach().float(), [g.float() for g in grads])
    (dense, dense_grads), (flex, flex_grads) = results["dense mask SDPA"], results["FlexAttention"]
    diff = {"out": (dense - flex).abs().max().item()}
    for label, a, b in zip("qkv", dense_grads, flex_grads):
        diff[f"d{label}"] = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
    return diff


def fmt(ms):
    return f"{ms:>10.2f}" if ms is not None else f"{'n/a':>10}"


def print_table(rows, args, dtype):
    print(f"\n{args.device}, {str(dtype).removeprefix('torch.')}, batch {args.batch_size}, 8 query / 4 KV heads, "
          f"documents of {MEAN_DOC_TOKENS} tokens on average, median of {args.repeats} calls, ms per layer\n")
    header = f"{'hidden':>6}{'seq':>6}  {'variant':<22}{'fwd':>10}{'fwd+bwd':>10}{'mask':>10}{'x dense':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        dense = next(d for d in rows if (d["hidden"], d["seq"], d["variant"]) == (r["hidden"], r["seq"], "dense mask SDPA"))
        key = "fwd_bwd_ms" if r["fwd_bwd_ms"] is not None else "fwd_ms"
        ratio = dense[key] / r[key]
        print(f"{r['hidden']:>6}{r['seq']:>6}  {r['variant']:<22}{fmt(r['fwd_ms'])}{fmt(r['fwd_bwd_ms'])}"
              f"{fmt(r['mask_ms'])}{ratio:>8.2f}x")
    print("\nx dense: the dense-mask row's time over this row's (fwd+bwd where both have it, else fwd)")
    checks = [r for r in rows if "check" in r]
    if checks:
        print("FlexAttention vs dense mask, max abs diff of the output (and max relative diff of dq, dk, dv):")
        for r in checks:
            print(f"  hidden {r['hidden']} seq {r['seq']}: " + ", ".join(f"{k} {v:.2e}" for k, v in r["check"].items()))


def evaluated_block_mask(ids):
    """The same BlockMask by create_block_mask, which evaluates the mask function at all T x T positions."""
    doc = document_ids(ids == BOS)

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])
    return create_block_mask(causal_same_document, ids.shape[0], None, ids.shape[1], ids.shape[1], device=ids.device)


def print_mask_builds(args):
    builders = {"dense (B,1,T,T)": lambda ids: dense_document_mask(ids == BOS),
                "BlockMask from boundaries": lambda ids: document_block_mask(ids == BOS),
                "create_block_mask": evaluated_block_mask}
    print(f"\nbuilding the mask once, ms (median of {args.repeats})\n")
    print(f"{'batch':>6}{'seq':>6}" + "".join(f"{name:>28}" for name in builders))
    for batch in map(int, args.mask_batch_sizes.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            ids = packed_ids(batch, seq_len, args.device)
            times = [median_ms(lambda: build(ids), args.device, args.repeats) for build in builders.values()]
            print(f"{batch:>6}{seq_len:>6}" + "".join(f"{t:>28.2f}" for t in times), flush=True)


def main(argv=None):
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32"))
    rows = []
    for hidden in map(int, args.hidden_sizes.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            print(f"hidden {hidden} seq {seq_len} ...", file=sys.stderr, flush=True)
            rows += run_cell(hidden, seq_len, args, dtype)
    print_table(rows, args, dtype)
    print_mask_builds(args)


if __name__ == "__main__":
    main()
