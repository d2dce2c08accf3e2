"""One optimizer step over a global batch, and the per-step figures the loop keeps on
the device until it reads them anyway."""
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from common.labels import IGNORE_INDEX
from model.document_mask import document_causal_mask
from trainer.distributed import all_reduce_sum
from trainer.hooks import StepHooks
from trainer.parallel import as_local_scalar, gradient_sync


@dataclass(frozen=True)
class StepContext:
    """What every step of a run uses, fixed for the run."""
    net: torch.nn.Module  # the module the loop calls: DDP, FSDP or torch.compile around the model
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    world_size: int
    autocast: AbstractContextManager = nullcontext()  # torch.autocast, or nothing for fp32
    doc_mask: bool = False  # attention stays inside each document of a packed window
    bos_id: int | None = None  # where documents start, for doc_mask, unless the data marks them
    grad_clip: float = 0.0  # 0 or less: no clipping
    hooks: StepHooks = field(default_factory=StepHooks)  # nothing, except in tests (trainer/hooks.py)


@dataclass(frozen=True)
class Requests:
    """What this rank asks of the step. They travel in the step's one all-reduce, so every rank
    learns at the same step that any rank asked."""
    stop: bool = False  # a preemption signal arrived here
    save: bool = False  # rank 0's clock says a time-based save is due (other ranks say False)


@dataclass
class StepResult:
    stats: torch.Tensor  # on the device, summed over ranks: (loss x tokens, aux loss, tokens)
    skipped: bool  # a non-finite loss or gradient norm on some rank: no update was made
    stop: bool  # some rank was asked to stop (preemption)
    save: bool  # rank 0 asked for a save

    def mean_loss(self) -> float:
        return (self.stats[0] / self.stats[2]).item()


def attention_mask(batch, doc_mask: bool, bos_id: int | None):
    """The document mask of a batch of packed windows, or None for plain causal attention. A
    batch is (input ids, next-token targets) or, where the data marks where its documents start,
    (input ids, targets, starts): conversations, whose every turn begins with BOS. Otherwise
    each BOS starts a document."""
    if not doc_mask:
        return None
    starts = batch[2] if len(batch) > 2 else batch[0] == bos_id
    return document_causal_mask(starts)


def optimizer_step(ctx: StepContext, micro_batches, requests: Requests = Requests()) -> StepResult:
    """Forward/backward over the micro-batches of (input ids, next-token targets[, document
    starts]), and one update.

    Every token of the global batch weighs the same: each micro-batch's summed loss
    is divided by the batch's token count over all ranks (DDP then averages the
    ranks' gradients, hence the world_size factor). With padding, MiniMind's
    per-micro-batch mean would weigh short documents more, and differently per world size.

    The host reads the device once, for the skip/stop/save decision agreed by all ranks: on
    a GPU every read waits for the queued work to finish, so the next step cannot be queued.
    """
    device, accum = ctx.device, len(micro_batches)
    batches = [[t.to(device, non_blocking=True) for t in batch] for batch in micro_batches]
    tokens = all_reduce_sum(sum((batch[1] != IGNORE_INDEX).sum() for batch in batches).double())
    # At least one: a global batch with no target at all (fine-tuning data where every
    # conversation lost its replies) then has a zero loss, not 0 / 0.
    per_rank_tokens = (tokens.clamp(min=1) / ctx.world_size).float()
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        x, targets = batch[0], batch[1]
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with gradient_sync(ctx.net, enabled=i == accum - 1):
            with ctx.autocast:
                mask = attention_mask(batch, ctx.doc_mask, ctx.bos_id)
                out = ctx.net(x, attention_mask=mask, shift_labels=targets, num_items_in_batch=per_rank_tokens)
                loss = ctx.hooks.loss(out.loss + out.aux_loss / accum)
            ctx.scaler.scale(loss).backward()
        loss_sum += out.loss.detach().float() * per_rank_tokens
        aux_sum += out.aux_loss.detach().float() / accum

    ctx.scaler.unscale_(ctx.optimizer)
    grad_norm = as_local_scalar(
        torch.nn.utils.clip_grad_norm_(ctx.net.parameters(), ctx.grad_clip if ctx.grad_clip > 0 else math.inf))
    # Under fp16 the GradScaler owns inf gradients: it skips the step and lowers its scale.
    bad_grad = torch.zeros((), device=device) if ctx.scaler.is_enabled() else (~torch.isfinite(grad_norm)).float()
    # One collective carries every per-step agreement: the loss for logging, a non-finite
    # loss or gradient norm on any rank, and what any rank requested.
    flags = torch.stack([loss_sum, aux_sum, (~torch.isfinite(loss_sum)).float(), bad_grad.to(loss_sum.dtype),
                         torch.full((), float(requests.stop), device=device),
                         torch.full((), float(requests.save), device=device)])
    all_reduce_sum(flags)
    bad_loss, bad_grad, stop, save = read_flags(flags[2:])
    skipped = bad_loss or bad_grad
    if not skipped:
        ctx.scaler.step(ctx.optimizer)
    ctx.scaler.update()
    ctx.optimizer.zero_grad(set_to_none=True)
    return StepResult(torch.stack([flags[0].double(), flags[1].double() / ctx.world_size, tokens]), skipped, stop,
                      save)


def read_flags(flags: torch.Tensor) -> list[bool]:
    """flags > 0, read off the device in ONE host sync (as the bits of one integer)."""
    bits = (flags > 0).long() << torch.arange(len(flags), device=flags.device)
    code = int(bits.sum().item())
    return [bool(code >> i & 1) for i in range(len(flags))]


class StepTotals:
    """Per-step figures summed on the device and read by the host only when it logs or
    saves anyway, so that ordinary steps stay free of device-to-host reads."""

    def __init__(self, device):
        self.window = torch.zeros(3, dtype=torch.float64, device=device)  # StepResult.stats summed over updates
        self.updates = 0
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)  # every step's, since the last read
        self.steps = 0  # since the last read

    def add(self, result: StepResult):
        self.tokens += result.stats[2]
        self.steps += 1
        if not result.skipped:  # a skipped step's NaN loss would hide the others' in the mean
            self.window += result.stats
            self.updates += 1

    def take_tokens(self) -> tuple[int, int]:
        """(tokens, steps) since the last call."""
        tokens, steps = int(self.tokens.item()), self.steps
        self.tokens.zero_()
        self.steps = 0
        return tokens, steps

    def take_window(self) -> tuple[float, float]:
        """(token-weighted mean loss, mean aux loss) over the updates since the last call."""
        loss_x_tokens, aux, tokens = self.window.tolist()
        updates, self.updates = self.updates, 0
        self.window.zero_()
        if not updates:
            return math.nan, math.nan
        return loss_x_tokens / tokens, aux / updates
