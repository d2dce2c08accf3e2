"""One optimizer step over a global batch, what it trains with, and the per-step figures the
loop keeps on the device until it reads them anyway."""
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from common.labels import IGNORE_INDEX
from model.document_mask import document_causal_mask
from trainer.distributed import all_reduce_sum, as_local_scalar, gradient_sync


@dataclass(frozen=True)
class TrainParts:
    """What the loop trains, and with what; built once (trainer/loop.py's build_parts)."""
    model: torch.nn.Module  # the MiniMindForCausalLM (sharded in place under FSDP)
    net: torch.nn.Module  # the module the loop calls: DDP, FSDP or torch.compile around the model
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scaling; disabled otherwise
    autocast: AbstractContextManager  # torch.autocast, or nothing for fp32
    device: torch.device
    world_size: int
    doc_mask: bool = False  # attention stays inside each document of a packed window
    bos_id: int | None = None  # where documents start, for doc_mask, unless the data marks them


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


def optimizer_step(parts: TrainParts, micro_batches, grad_clip: float = 0.0,
                   requests: Requests = Requests()) -> StepResult:
    """Forward/backward over the micro-batches of (input ids, next-token targets[, document
    starts]), and one update; grad_clip 0 or less: no clipping.

    Every token of the global batch weighs the same: each micro-batch's summed loss is divided
    by the batch's token count over all ranks (DDP then averages the ranks' gradients, hence the
    world_size factor). With padding, MiniMind's per-micro-batch mean would weigh short
    documents more, and differently per world size.

    The host reads the device once, for the skip/stop/save decision agreed by all ranks: on
    a GPU every read waits for the queued work to finish, so the next step cannot be queued.
    """
    device, accum = parts.device, len(micro_batches)
    batches = [[t.to(device, non_blocking=True) for t in batch] for batch in micro_batches]
    tokens = all_reduce_sum(sum((batch[1] != IGNORE_INDEX).sum() for batch in batches).double())
    # At least one: a global batch with no target at all (fine-tuning data where every
    # conversation lost its replies) then has a zero loss, not 0 / 0.
    per_rank_tokens = (tokens.clamp(min=1) / parts.world_size).float()
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with gradient_sync(parts.net, enabled=i == accum - 1):
            with parts.autocast:
                mask = attention_mask(batch, parts.doc_mask, parts.bos_id)
                out = parts.net(batch[0], attention_mask=mask, shift_labels=batch[1],
                                num_items_in_batch=per_rank_tokens)
                loss = out.loss + out.aux_loss / accum
            parts.scaler.scale(loss).backward()
        loss_sum += out.loss.detach().float() * per_rank_tokens
        aux_sum += out.aux_loss.detach().float() / accum

    parts.scaler.unscale_(parts.optimizer)
    grad_norm = as_local_scalar(
        torch.nn.utils.clip_grad_norm_(parts.net.parameters(), grad_clip if grad_clip > 0 else math.inf))
    # Under fp16 the GradScaler owns inf gradients: it skips the step and lowers its scale.
    bad_grad = torch.zeros((), device=device) if parts.scaler.is_enabled() else (~torch.isfinite(grad_norm)).float()
    # One collective carries every per-step agreement: the loss for logging, a non-finite
    # loss or gradient norm on any rank, and what any rank requested.
    flags = torch.stack([loss_sum, aux_sum, (~torch.isfinite(loss_sum)).float(), bad_grad.to(loss_sum.dtype),
                         torch.full((), float(requests.stop), device=device),
                         torch.full((), float(requests.save), device=device)])
    all_reduce_sum(flags)
    bad_loss, bad_grad, stop, save = read_flags(flags[2:])
    skipped = bad_loss or bad_grad
    if not skipped:
        parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    return StepResult(torch.stack([flags[0].double(), flags[1].double() / parts.world_size, tokens]), skipped, stop,
                      save)


def read_flags(flags: torch.Tensor) -> list[bool]:
    """flags > 0, read off the device in ONE host sync (as the bits of one integer)."""
    bits = (flags > 0).long() << torch.arange(len(flags), device=flags.device)
    code = int(bits.sum().item())
    return [bool(code >> i & 1) for i in range(len(flags))]


class StepTotals:
    """The loss of the steps since the last log line, summed on the device and read by the
    host only when it logs, so that ordinary steps stay free of device-to-host reads."""

    def __init__(self, device):
        self.window = torch.zeros(3, dtype=torch.float64, device=device)  # StepResult.stats summed over updates
        self.updates = 0

    def add(self, result: StepResult):
        if not result.skipped:  # a skipped step's NaN loss would hide the others' in the mean
            self.window += result.stats
            self.updates += 1

    def take_window(self) -> tuple[float, float]:
        """(token-weighted mean loss, mean aux loss) over the updates since the last call."""
        loss_x_tokens, aux, tokens = self.window.tolist()
        updates, self.updates = self.updates, 0
        self.window.zero_()
        if not updates:
            return math.nan, math.nan
        return loss_x_tokens / tokens, aux / updates
