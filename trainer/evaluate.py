"""What the run is scored on: the held-out loss and bits per byte (evaluate), and downstream
accuracy on a multiple-choice task, scored with our own model code; validate() runs both.

Bits per byte is the held-out NLL in bits over the UTF-8 bytes of the targets' text
(dataset/token_bytes.py): unlike loss per token it does not depend on the tokenizer.

A task file is JSONL, one item per line (dataset/tasks/ ships one, built by
scripts/build_eval_task.py):

    {"context": "...", "choices": ["...", "...", "...", "..."], "label": 0}

An item is right when the model gives its gold choice the highest log-likelihood as
a continuation of the context. The rules are lm-evaluation-harness's (0.4.13,
`output_type: multiple_choice` with the hf model), so `lm_eval --model hf` on the
exported folder gets the same numbers (tests/test_downstream.py checks it):

  * the continuation of a choice is target_delimiter + choice (" " + choice);
  * whitespace at the end of the context moves to the front of the continuation;
  * context + continuation is tokenized as one string and the context alone on its
    own; the continuation's tokens are the whole's tokens past the context's count,
    and the model reads context tokens + those tokens;
  * acc picks the choice with the largest summed log-likelihood of its tokens;
    acc_norm divides that by the choice's length in characters (without the
    delimiter) first; ties go to the first choice (numpy's argmax);
  * a standard error is the sample standard deviation over items / sqrt(n).

One difference is a choice, not a rule: the hf model feeds no BOS to our tokenizer
unless asked (`add_bos_token=True`), while our model is trained on documents that start
with BOS. `bos=True` (the default here) matches `add_bos_token=True`; `bos=False` matches
lm-eval's default.

In the training loop (--eval_task) the task is encoded once and scored by
evaluate_task_in_group: each rank scores its share and the counts [n, right, right_norm]
are summed (under FSDP every rank scores every item).

Per item, choice_logprobs gives every choice's log-likelihood and judge its verdicts.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import DataError
from common.labels import IGNORE_INDEX
from dataset.chat import generation_prompt
from dataset.lm_dataset import iter_raw_lines, load_json_line
from dataset.token_bytes import bits_per_byte, target_bytes
from trainer.distributed import all_reduce_sum
from trainer.step import attention_mask

TARGET_DELIMITER = " "  # lm-eval's default, and what dataset/tasks/*.yaml use


@dataclass(frozen=True)
class TaskItem:
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class EncodedItem:
    context_ids: tuple[int, ...]
    continuation_ids: tuple[tuple[int, ...], ...]  # one per choice
    choice_chars: tuple[int, ...]  # acc_norm's divisor: len(choice), the delimiter not counted
    label: int


# -----------------------------------------------------------------------------
# reading a task file

TASK_LINES = 'a .jsonl file of {"context", "choices", "label"} items (dataset/tasks/ holds one)'


def load_task(path, flag: str = "--eval_task") -> list[TaskItem]:
    """Every item of a task file; a bad line is a DataError naming the file and line (and a
    missing or empty file names `flag`)."""
    items = []
    for line_number, _, raw in iter_raw_lines(path, flag, TASK_LINES):
        items.append(parse_item(raw, f"{path}:{line_number}"))
    return items


def parse_item(raw: bytes, where: str) -> TaskItem:
    expected = 'expected {"context": str, "choices": [str, str, ...], "label": index of the gold choice}'
    obj = load_json_line(raw, where, expected)
    if not isinstance(obj, dict):
        raise DataError(f"{where}: not a JSON object; {expected}")
    for field in ("context", "choices", "label"):
        if field not in obj:
            raise DataError(f'{where}: no "{field}" field; {expected}')
    context, choices, label = obj["context"], obj["choices"], obj["label"]
    if not isinstance(context, str):
        raise DataError(f'{where}: "context" is not a string; {expected}')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise DataError(f'{where}: "choices" must be a list of at least 2 non-empty strings; {expected}')
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise DataError(f'{where}: "label" must be an integer from 0 to {len(choices) - 1}, got {label!r}')
    return TaskItem(context, tuple(choices), label)


# -----------------------------------------------------------------------------
# tokenizing: lm-eval's split of context and continuation

def encode_item(tokenizer, item: TaskItem, bos: bool = True, delimiter: str = TARGET_DELIMITER) -> EncodedItem:
    prefix = [tokenizer.bos_token_id] if bos else []
    conts = []
    for choice in item.choices:
        context, continuation = item.context, delimiter + choice
        if not context:
            # lm-eval conditions an empty context on the BOS token (its prefix_token_id).
            context_ids, cont_ids = [tokenizer.bos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
        else:
            stripped = context.rstrip()
            context, continuation = stripped, context[len(stripped):] + continuation
            # Tokenized whole, so that a token spanning the boundary is tokenized as it
            # would be in running text; its tail then belongs to the continuation.
            whole = prefix + tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = prefix + tokenizer.encode(context, add_special_tokens=False)
            cont_ids = whole[len(context_ids):]
        conts.append(tuple(cont_ids))
    if not all(conts):
        raise DataError(f"a choice of item {item.context[:40]!r}... tokenizes to nothing after its context")
    return EncodedItem(tuple(context_ids), tuple(conts), tuple(len(c) for c in item.choices), item.label)


def encode_task(tokenizer, items, bos: bool = True, chat: bool = False) -> list[EncodedItem]:
    """chat: each context is asked as a chat model is asked (lm_eval --apply_chat_template): as a
    user turn, then the prompt to answer, and the choice follows the prompt with no delimiter.
    The rendered prompt starts with BOS already (add_bos_token=False in lm_eval)."""
    if chat:
        asked = [TaskItem(generation_prompt([{"role": "user", "content": item.context}]), item.choices, item.label)
                 for item in items]
        return [encode_item(tokenizer, item, bos=False, delimiter="") for item in asked]
    return [encode_item(tokenizer, item, bos) for item in items]


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s share: every world_size-th item. The shares' counts add up to the whole."""
    return items[rank::world_size]


# -----------------------------------------------------------------------------
# scoring

@torch.no_grad()
def choice_logprobs(model, items: list[EncodedItem], device=None, autocast=None, batch_size: int = 32,
                    max_length: int | None = None) -> list[list[float]]:
    """Summed log-likelihood of every choice's continuation tokens: one list per item.

    `model` is what the caller runs forward (a MiniMindForCausalLM or its DDP wrapper:
    anything that takes `logits_to_keep` and returns `.logits`), already on `device`.
    Every (item, choice) pair is one row; rows are batched longest first so that padding
    stays small. Right padding needs no attention mask: under a causal mask no real
    token sees a pad. Under FSDP every rank must make the same number of forward calls:
    give every rank as many items (and choices per item) and the same batch_size.
    """
    device = device or next(model.parameters()).device
    autocast = autocast or nullcontext()
    max_length = max_length or _max_length(model)
    rows = [(i, j) for i, item in enumerate(items) for j in range(len(item.continuation_ids))]
    # lm-eval's input: context + continuation minus the last token, cut from the left to max_length.
    inputs = {(i, j): (items[i].context_ids + items[i].continuation_ids[j])[-(max_length + 1):][:-1] for i, j in rows}
    rows.sort(key=lambda row: -len(inputs[row]))
    out = [[0.0] * len(item.continuation_ids) for item in items]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            sums = _batch_logprobs(model, [inputs[r] for r in batch],
                                   [items[i].continuation_ids[j] for i, j in batch], device, autocast)
            for (i, j), value in zip(batch, sums.tolist()):
                out[i][j] = value
    finally:
        model.train(was_training)
    return out


def _max_length(model) -> int:
    config = getattr(model, "config", None) or model.module.config  # DDP keeps the model in .module
    return config.max_position_embeddings


def _batch_logprobs(model, inputs, continuations, device, autocast) -> torch.Tensor:
    width = max(len(ids) for ids in inputs)
    input_ids = torch.zeros(len(inputs), width, dtype=torch.long)
    for row, ids in enumerate(inputs):
        input_ids[row, :len(ids)] = torch.tensor(ids)
    # A continuation's k tokens are predicted by the last k positions of its row's input.
    # Only the span of positions holding some row's continuation goes through the output
    # head (logits_to_keep): the head over the whole batch would cost as much as the model.
    first = min(len(ids) - len(cont) for ids, cont in zip(inputs, continuations))
    with autocast:
        logits = model(input_ids.to(device), logits_to_keep=width - first).logits
    sums = []
    for row, (ids, cont) in enumerate(zip(inputs, continuations)):
        picked = logits[row, len(ids) - len(cont) - first:len(ids) - first].float()
        logprobs = F.log_softmax(picked, dim=-1)
        target = torch.tensor(cont, device=logprobs.device)
        sums.append(logprobs.gather(1, target[:, None]).sum())
    return torch.stack(sums).double().cpu()


def judge(item: EncodedItem, logprobs: list[float]) -> tuple[bool, bool]:
    """(acc, acc_norm) of one item: is the gold choice the first best by summed
    log-likelihood, and by log-likelihood per character of the choice?"""
    best = max(range(len(logprobs)), key=lambda j: (logprobs[j], -j))
    per_char = [lp / n for lp, n in zip(logprobs, item.choice_chars)]
    best_norm = max(range(len(per_char)), key=lambda j: (per_char[j], -j))
    return best == item.label, best_norm == item.label


def count_correct(model, items: list[EncodedItem], device=None, autocast=None, batch_size: int = 32) -> torch.Tensor:
    """float64 [items, right by acc, right by acc_norm] on the model's device: a rank's
    share, ready for all_reduce (sums add up across shares)."""
    device = device or next(model.parameters()).device
    verdicts = [judge(item, lps) for item, lps in
                zip(items, choice_logprobs(model, items, device, autocast, batch_size))]
    return torch.tensor([len(items), sum(a for a, _ in verdicts), sum(n for _, n in verdicts)],
                        dtype=torch.float64, device=device)


@dataclass(frozen=True)
class DownstreamResult:
    n: int
    acc: float
    acc_norm: float
    acc_stderr: float
    acc_norm_stderr: float

    @classmethod
    def from_counts(cls, counts) -> "DownstreamResult":
        """From count_correct's [n, right, right_norm] (a tensor or three numbers)."""
        n, right, right_norm = (float(x) for x in counts)
        acc, acc_norm = right / max(n, 1), right_norm / max(n, 1)
        return cls(int(n), acc, acc_norm, mean_stderr(acc, n), mean_stderr(acc_norm, n))

    def line(self) -> str:
        return (f"acc={self.acc:.4f} acc_norm={self.acc_norm:.4f} "
                f"acc_stderr={self.acc_stderr:.4f} acc_norm_stderr={self.acc_norm_stderr:.4f}")


def mean_stderr(p: float, n: float) -> float:
    """lm-eval's standard error of a mean, sample std / sqrt(n), for 0/1 values with mean p:
    their squared deviations sum to n p (1 - p), so the sample variance is n p (1 - p) / (n - 1)."""
    if n < 2:
        return float("nan")
    return math.sqrt(p * (1 - p) / (n - 1))


def evaluate_task(model, items: list[EncodedItem], device=None, autocast=None,
                  batch_size: int = 32) -> DownstreamResult:
    """acc and acc_norm with their standard errors, all items here (one process)."""
    return DownstreamResult.from_counts(count_correct(model, items, device, autocast, batch_size))


def evaluate_task_in_group(net, items: list[EncodedItem], device, autocast, rank: int, world_size: int,
                           sharded: bool) -> DownstreamResult:
    """The score of the whole task, the same on every rank of a training job. Each DDP rank
    scores its share and the counts are summed; under FSDP every forward is a collective, and
    shares can differ in rows and so in forward calls, so every rank scores every item."""
    counts = count_correct(net, items if sharded else shard(items, rank, world_size), device, autocast)
    if not sharded:
        all_reduce_sum(counts)
    return DownstreamResult.from_counts(counts)


# -----------------------------------------------------------------------------
# in the training loop

def validate(parts, val_loader, task, device, rank: int, world_size: int, byte_lengths, sharded: bool):
    """(val loss and bits per byte, the task's scores), each None where the run has no such data.
    Both are collectives: every rank calls this at the same steps. parts: the loop's TrainParts."""
    val, scores = None, None
    if val_loader is not None:
        # Each held-out document is scored on its own context, whatever --doc_mask trains with:
        # its bits per byte then do not depend on which documents were packed before it, and
        # padded, packed and document-masked runs compare on one yardstick. A run that trains
        # without FlexAttention validates with the dense mask, so nothing new is compiled.
        val = evaluate(parts.net, val_loader, parts.autocast, device, byte_lengths, True, parts.bos_id,
                       flex=None if parts.doc_mask else False)
    if task is not None:
        scores = evaluate_task_in_group(parts.net, task, device, parts.autocast, rank, world_size, sharded)
    return val, scores


@torch.no_grad()
def evaluate(net, val_loader, autocast, device, byte_lengths, doc_mask: bool = False,
             bos_id: int | None = None, flex: bool | None = None) -> tuple[float, float]:
    """(mean token loss, bits per byte) over the fixed validation slice of (input ids, next-token
    targets[, document starts]), summed over all ranks; dataset/token_bytes.py says which targets
    and bytes count. doc_mask: each document of a window attends to itself only (flex as in
    trainer/step.py's attention_mask)."""
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in val_loader:
        batch = [t.to(device) for t in batch]
        x, targets = batch[0], batch[1]
        with autocast:
            out = net(x, attention_mask=attention_mask(batch, doc_mask, bos_id, flex), shift_labels=targets,
                      num_items_in_batch=1)  # a sum, not a mean
        totals += torch.stack([out.loss.double(), (targets != IGNORE_INDEX).sum().double(),
                               target_bytes(targets, byte_lengths).double()])
    net.train()
    all_reduce_sum(totals)
    nll, tokens, n_bytes = totals.tolist()
    return nll / max(tokens, 1), bits_per_byte(nll, n_bytes)
