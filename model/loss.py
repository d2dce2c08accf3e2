"""The next-token loss: the label convention and a cross-entropy that works in row chunks.

F.cross_entropy on (tokens, vocab) logits makes fp32 copies of the whole logit matrix
on the way in and out (the upcast, the log-softmax, its gradient, the zero-filled
gradient of the gather): at 2,720 tokens and MiniMind's 6,400 words that is four 70 MB
tensors a step, fresh from the allocator, which on a CPU costs as much as the lm_head's
matmuls. ChunkedCrossEntropy keeps the logits in their own dtype and upcasts a few
rows at a time, so the fp32 work stays small; its loss and gradient are the same
arithmetic (the log-sum-exp in fp32, the gradient softmax - one-hot in fp32, rounded
once to the logits' dtype).
"""
import torch

# common.labels's value, restated: this file travels alone in a Hugging Face export's remote code.
IGNORE_INDEX = -100


def chunk_elements(device: torch.device) -> int:
    """How many logits to upcast at a time. A CPU core walks each chunk several times (upcast,
    exp, scatter, scale), fastest while the chunk stays in its L2 cache: on the 2-core AMX Xeon,
    chunks of 1 MB of fp32 took 0.6x (bf16 logits) to 0.8x (fp32) the time of 16 MB ones
    (scripts/bench/bench_ops.py loss). A GPU pays per kernel launch instead, and under torch.compile the
    loop is unrolled into the graph, whose fused kernels make no fp32 copies to keep small: both
    take fewer, larger chunks (16 MB)."""
    if device.type == "cpu" and not torch.compiler.is_compiling():
        return 1 << 18
    return 1 << 22


def row_chunks(logits, elements: int) -> list[slice]:
    """The row ranges of `logits` upcast together, `elements` at most (one row at least)."""
    rows = max(1, elements // logits.shape[1])
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of -log softmax(logits[row])[target[row]], rows with target -100 left out.

    logits: (rows, vocab) of any float dtype; targets: (rows,) int64; elements: logits
    upcast at a time (default: chunk_elements of their device)."""

    @staticmethod
    def forward(ctx, logits, targets, elements: int | None = None):
        work = torch.promote_types(logits.dtype, torch.float32)  # fp64 logits stay fp64
        valid = targets != IGNORE_INDEX
        picked = torch.where(valid, targets, 0).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=work, device=logits.device)
        total = torch.zeros((), dtype=work, device=logits.device)
        ctx.elements = chunk_elements(logits.device) if elements is None else elements
        for part in row_chunks(logits, ctx.elements):
            chunk = logits[part].to(work)
            lse[part] = torch.logsumexp(chunk, dim=1)
            target_logit = chunk.gather(1, picked[part]).squeeze(1)
            total += torch.where(valid[part], lse[part] - target_logit, 0.0).sum()
        ctx.save_for_backward(logits, picked, valid, lse)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        logits, picked, valid, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        # A fill on the device, not a tensor copied from the host.
        minus_one = torch.full(picked.shape, -1.0, dtype=lse.dtype, device=logits.device)
        for part in row_chunks(logits, ctx.elements):
            probs = (logits[part].to(lse.dtype) - lse[part, None]).exp_()
            probs.scatter_add_(1, picked[part], minus_one[part])
            grad[part] = probs.mul_(valid[part, None] * grad_total)
        return grad, None, None


def causal_lm_loss(logits, labels=None, shift_labels=None, num_items_in_batch=None):
    """Cross-entropy of next-token prediction, ignoring targets of -100.

    `labels` are aligned with the inputs and shifted here (MiniMind's layout);
    `shift_labels` are already shifted (the packed layout). By default the loss
    is a mean over valid targets; with `num_items_in_batch` it is the sum divided
    by that count, so accumulation and data parallelism can weight every token
    of a global batch equally.
    """
    if shift_labels is None:
        # The last position has no next token: pad its target rather than slice the
        # logits, which would copy them.
        shift_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    token_loss = ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1))
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
    return token_loss / num_items_in_batch
