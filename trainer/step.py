"""One optimizer step over a global batch: what it trains with, the loss it trains on (one
function, training_loss), and its figures by name, which the loop keeps on the device until it
reads them anyway."""
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


# How each named part of the training loss is averaged: per token of the global batch (the
# model's cross-entropy: each micro-batch's is its share of that mean already) or per micro-batch
# (the MoE load-balancing loss: the step trains on its mean over the micro-batches). The loss a
# step trains on, and the mean the log line shows over its window, both follow this.
PER_TOKEN, PER_MICRO_BATCH = "token", "micro-batch"
AVERAGED = {"loss": PER_TOKEN, "aux_loss": PER_MICRO_BATCH}


def training_loss(out, accum: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss a micro-batch trains on, from the model's output, and its named parts (AVERAGED).
    The cross-entropy is the model's own: its forward computes it from the targets, inside the
    graph --use_compile compiles. A new term is one more part here and its entry in AVERAGED."""
    parts = {"loss": out.loss, "aux_loss": out.aux_loss}
    shares = [part if AVERAGED[name] == PER_TOKEN else part / accum for name, part in parts.items()]
    return sum(shares[1:], start=shares[0]), parts


@dataclass
class StepResult:
    # On the device, float64: "tokens" (the targets trained on, summed over ranks), "grad_norm"
    # (the global gradient norm before clipping, 0 where it was not finite) with "finite_norms"
    # (1, or 0 for a step fp16's scaler skipped) and, for each part of the training loss, the sum
    # whose window the log divides (StepTotals): per-token parts summed over the tokens,
    # per-micro-batch ones as their mean over the ranks.
    figures: dict[str, torch.Tensor]
    skipped: bool  # a non-finite loss or gradient norm on some rank: no update was made
    stop: bool  # some rank was asked to stop (preemption)
    save: bool  # rank 0 asked for a save

    def mean_loss(self) -> float:
        return (self.figures["loss"] / self.figures["tokens"]).item()


def attention_mask(batch, doc_mask: bool, bos_id: int | None, flex: bool | None = None):
    """The document mask of a batch of packed windows, or None for plain causal attention. A
    batch is (input ids, next-token targets) or, where the data marks where its documents start,
    (input ids, targets, starts): conversations, whose every turn begins with BOS. Otherwise
    each BOS starts a document. flex: model/document_mask.py's choice of mask kind."""
    if not doc_mask:
        return None
    starts = batch[2] if len(batch) > 2 else batch[0] == bos_id
    return document_causal_mask(starts, flex)


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
    sums = {name: torch.zeros((), device=device) for name in AVERAGED}  # this rank's, before the all-reduce
    for i, batch in enumerate(batches):
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with gradient_sync(parts.net, enabled=i == accum - 1):
            with parts.autocast:
                mask = attention_mask(batch, parts.doc_mask, parts.bos_id)
                out = parts.net(batch[0], attention_mask=mask, shift_labels=batch[1],
                                num_items_in_batch=per_rank_tokens)
                loss, loss_parts = training_loss(out, accum)
            parts.scaler.scale(loss).backward()
        for name, part in loss_parts.items():  # per token: a sum over this rank's tokens; else its mean
            part = part.detach().float()
            sums[name] += part * per_rank_tokens if AVERAGED[name] == PER_TOKEN else part / accum

    parts.scaler.unscale_(parts.optimizer)
    grad_norm = as_local_scalar(
        torch.nn.utils.clip_grad_norm_(parts.net.parameters(), grad_clip if grad_clip > 0 else math.inf))
    finite_norm = torch.isfinite(grad_norm)
    # Under fp16 the GradScaler owns inf gradients: it skips the step and lowers its scale.
    bad_grad = torch.zeros((), device=device) if parts.scaler.is_enabled() else (~finite_norm).float()
    bad_loss = (~torch.isfinite(torch.stack(list(sums.values()))).all()).float()
    summed, asked = agree(sums, {"bad_loss": bad_loss, "bad_grad": bad_grad, "stop": requests.stop,
                                 "save": requests.save})
    skipped = asked["bad_loss"] or asked["bad_grad"]
    if not skipped:
        parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    # The global norm before clipping (every rank holds the same): how hard --grad_clip pulls. The
    # inf norm of a step fp16's scaler skipped stays out of the log's mean.
    figures = {"tokens": tokens, "grad_norm": torch.where(finite_norm, grad_norm, 0.0).double(),
               "finite_norms": finite_norm.double()}
    for name, value in summed.items():  # per-micro-batch parts: each rank's mean -> the mean over ranks
        figures[name] = value.double() if AVERAGED[name] == PER_TOKEN else value.double() / parts.world_size
    return StepResult(figures, skipped, asked["stop"], asked["save"])


def agree(figures: dict[str, torch.Tensor], questions: dict) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
    """Every rank's figures summed, and whether any rank answers yes to each question (a bool,
    or a device scalar > 0 for yes), in ONE all-reduce, and the answers read in ONE host read:
    on a GPU every read waits for the queued work to finish, so the next step cannot be queued.
    The figures stay on the device (float32, as the step keeps them)."""
    like = next(iter(figures.values()))
    answers = [torch.full((), float(q), device=like.device) if isinstance(q, bool) else q.to(like.dtype)
               for q in questions.values()]
    packed = all_reduce_sum(torch.stack([*figures.values(), *answers]))
    yes = (packed[len(figures):] > 0).tolist()
    return dict(zip(figures, packed)), dict(zip(questions, yes))


class StepTotals:
    """The figures of the steps since the last log line, summed on the device and read by the
    host only when it logs, so that ordinary steps stay free of device-to-host reads."""

    def __init__(self, device):
        # StepResult.figures, in one vector: one host read
        self.names = ("tokens", "grad_norm", "finite_norms", *AVERAGED)
        self.window = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.updates = 0

    def add(self, result: StepResult):
        if not result.skipped:  # a skipped step's NaN loss would hide the others' in the mean
            self.window += torch.stack([result.figures[name] for name in self.names])
            self.updates += 1

    def take_window(self) -> dict[str, float]:
        """Each part of the training loss, averaged as AVERAGED says over the updates since the
        last call (per token trained on, or per update), then the mean of their finite gradient norms."""
        sums = dict(zip(self.names, self.window.tolist()))
        updates, self.updates = self.updates, 0
        self.window.zero_()
        if not updates:
            return dict.fromkeys((*AVERAGED, "grad_norm"), math.nan)
        over = {PER_TOKEN: sums["tokens"], PER_MICRO_BATCH: updates}  # no trained token in the window: NaN
        means = {name: sums[name] / over[per] if over[per] else math.nan for name, per in AVERAGED.items()}
        return {**means, "grad_norm": sums["grad_norm"] / sums["finite_norms"] if sums["finite_norms"] else math.nan}
