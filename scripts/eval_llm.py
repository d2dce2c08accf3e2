"""Generate text with a trained MiniMind, chat with a fine-tuned one, or measure its perplexity
on held-out JSONL.

    python scripts/eval_llm.py --prompt "Once upon a time"              # out/pretrain_512.pth
    python scripts/eval_llm.py --weight_path out/full_sft_512.pth --chat --prompt 'What does `json.dumps` do?'
    python scripts/eval_llm.py --hidden_size 768                         # interactive, in a terminal
    python scripts/eval_llm.py --hf_dir hf_out --prompt "..." --prompt "..." --greedy
    python scripts/eval_llm.py --weight_path checkpoints/pretrain_512_resume.pth --ppl_data val.jsonl
    python scripts/eval_llm.py --weight_path out/quickstart/quickstart_128.pth --task dataset/tasks/minimind_heldout.jsonl

The weights may be a .pth or .safetensors (the config beside it, x.pth -> x.json, which the
trainer writes, describes the model; without one, the shape flags do), a resume checkpoint
or a folder written by convert_model.py (a stored config wins; flags passed must agree).
A pretrained model continues text, so a prompt is fed as BOS + prompt, the same layout
as the training samples. With --chat, a prompt is a user's turn: the conversation so far is
rendered by the chat template (dataset/chat.py), the model answers after the generation
prompt and stops at <|im_end|>; in a terminal the conversation goes on turn after turn.

--ppl_data takes text ({"text": ...} lines: loss over every token after BOS) or conversations
({"conversations": [...]} lines: loss over the assistant's replies, as fine-tuning trains them).

--task scores a multiple-choice task file (trainer/evaluate.py: lm-evaluation-harness's
acc and acc_norm, with their standard errors) and prints them as the last line:
`acc=0.XXXX acc_norm=0.XXXX acc_stderr=0.XXXX acc_norm_stderr=0.XXXX`.
"""
import math
import sys
from contextlib import nullcontext
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch

from common.errors import UserError, WeightsError, report_user_errors
from common.labels import IGNORE_INDEX
from dataset.chat import generation_prompt
from dataset.lm_dataset import frame_document, iter_jsonl_texts, iter_raw_lines, load_tokenizer
from dataset.token_bytes import bits_per_byte, target_bytes, token_byte_lengths
from model.shape_flags import SHAPE_FLAGS, flag_default
from model.weights import load_model
from common.cli import OneLineArgumentParser
from trainer.device import resolve_device
from trainer.evaluate import encode_task, evaluate_task, load_task
from trainer.config import default_weight_path


class TextStreamer:
    """Prints the text of new tokens as generate() produces them (transformers' put/end
    protocol: the prompt first, which is not printed, then each new token).

    Decoding the whole continuation each step, rather than token by token, keeps
    byte-level BPE pieces of one multi-byte character together.
    """

    def __init__(self, tokenizer, out=None):
        self.tokenizer = tokenizer
        self.out = out or sys.stdout
        self.ids, self.printed, self.prompt_seen = [], 0, False

    def put(self, token_ids):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(token_ids.reshape(-1).tolist())  # one new token per step, batch of 1
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # a character whose remaining bytes are still to come
        self._write(text)

    def end(self):
        self._write(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        self.out.write("\n")
        self.out.flush()
        self.ids, self.printed, self.prompt_seen = [], 0, False

    def _write(self, text):
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def generate_text(model, tokenizer, prompt, args, out=None):
    """Stream a continuation of `prompt` to `out`; returns the new token ids."""
    ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False).input_ids
    out = out or sys.stdout
    out.write(prompt)
    return generate_ids(model, tokenizer, ids, args, out)


def chat_reply(model, tokenizer, turns, args, out=None):
    """Stream the assistant's answer to the conversation `turns` to `out`; returns its token ids
    (through <|im_end|>, where it stopped there)."""
    ids = tokenizer(generation_prompt(turns), add_special_tokens=False).input_ids
    return generate_ids(model, tokenizer, ids, args, out or sys.stdout)


def generate_ids(model, tokenizer, ids, args, out):
    context = model.config.max_position_embeddings
    room = context - len(ids)
    if room < 1:
        raise UserError(f"the prompt is {len(ids)} tokens, and the model's context holds {context}: shorten it")
    if args.max_new_tokens > room:
        print(f"note: --max_new_tokens {args.max_new_tokens} cut to {room}: with the prompt's {len(ids)} tokens "
              f"that fills the model's context of {context}", file=sys.stderr)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    tokens = model.generate(
        input_ids,
        max_new_tokens=min(args.max_new_tokens, room),
        do_sample=bool(args.do_sample),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        streamer=TextStreamer(tokenizer, out),
    )
    return tokens[0, len(ids):].tolist()


@torch.no_grad()
def perplexity(model, tokenizer, path, max_docs=None, max_seq_len=512, batch_size=8):
    """(docs, tokens, mean loss, bits per byte) over the next-token targets of each document.

    A document is laid out as in training (dataset/lm_dataset.py): BOS + text + EOS,
    truncated to max_seq_len with the EOS kept; the targets are every real token
    after BOS (EOS included, as in the trainer's validation; dataset/token_bytes.py).
    Right padding needs no attention mask under a causal model.
    """
    device = next(model.parameters()).device
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    byte_lengths = token_byte_lengths(tokenizer, model.config.vocab_size)
    docs = tokens = n_bytes = 0
    total_loss = 0.0
    batch = []
    for _, text in iter_jsonl_texts(path):
        if max_docs is not None and docs + len(batch) >= max_docs:
            break
        ids = tokenizer(text, add_special_tokens=False).input_ids
        batch.append(frame_document(ids, bos, eos, max_seq_len))
        if len(batch) == batch_size:
            docs, tokens, total_loss, n_bytes = _add_batch(model, batch, pad, device, byte_lengths,
                                                           docs, tokens, total_loss, n_bytes)
            batch = []
    if batch:
        docs, tokens, total_loss, n_bytes = _add_batch(model, batch, pad, device, byte_lengths,
                                                       docs, tokens, total_loss, n_bytes)
    return docs, tokens, total_loss / max(tokens, 1), bits_per_byte(total_loss, n_bytes)


def _add_batch(model, batch, pad, device, byte_lengths, docs, tokens, total_loss, n_bytes):
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    targets = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
    # shift_labels are already aligned with the logits; num_items_in_batch=1 turns the
    # model's mean into a sum, so batches of any size add up exactly.
    out = model(input_ids.to(device), shift_labels=targets.to(device), num_items_in_batch=1)
    return (docs + len(batch), tokens + int((targets != IGNORE_INDEX).sum()), total_loss + out.loss.item(),
            n_bytes + int(target_bytes(targets, byte_lengths)))


@torch.no_grad()
def conversation_loss(model, tokenizer, path, max_docs=None, max_seq_len=512, batch_size=8):
    """(conversations, tokens, mean loss, bits per byte) over the assistant's replies: the very
    samples and targets fine-tuning trains on (dataset/sft_dataset.py), each conversation alone;
    the first max_docs conversations only, where given."""
    from torch.utils.data import DataLoader, Subset

    from dataset.sft_dataset import SFTDataset
    from trainer.evaluate import evaluate

    data = SFTDataset(path, tokenizer, max_seq_len, flag="--ppl_data")
    if max_docs is not None:
        data = Subset(data, range(min(max_docs, len(data))))
    device = next(model.parameters()).device
    batches = list(DataLoader(data, batch_size=batch_size))
    loss, bpb = evaluate(model, batches, nullcontext(), device, token_byte_lengths(tokenizer, model.config.vocab_size))
    return len(data), sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in batches), loss, bpb


def is_conversations(path) -> bool:
    """Whether a JSONL file's first line is a conversation rather than a text."""
    for _, _, raw in iter_raw_lines(path, "--ppl_data"):
        return b'"conversations"' in raw
    return False


def interactive(model, tokenizer, args):
    if args.chat:
        print("Chat: type a message and press Enter (empty line or Ctrl-D quits).")
    else:
        print("Type a prompt and press Enter (empty line or Ctrl-D quits).")
    turns = []
    while True:
        try:
            prompt = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not prompt.strip():
            return
        if not args.chat:
            generate_text(model, tokenizer, prompt, args)
            continue
        turns.append({"role": "user", "content": prompt})
        try:
            reply = tokenizer.decode(chat_reply(model, tokenizer, turns, args), skip_special_tokens=True)
        except UserError as exc:  # the conversation outgrew the context: say so, and let the user go on
            print(f"error: {exc}; an empty line ends this chat")
            turns.pop()
            continue
        turns.append({"role": "assistant", "content": reply})


# -----------------------------------------------------------------------------
# command line

def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight_path", help="weights .pth / .safetensors or resume checkpoint "
                                        "(default: out/pretrain_{hidden}[_moe].pth)")
    p.add_argument("--hf_dir", help="a folder written by scripts/convert_model.py, instead of --weight_path")
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"model shape (default {flag_default(name)}; a stored config wins)")
    p.add_argument("--tokenizer_path", help="tokenizer folder (default: --hf_dir if it has one, else model/)")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (with --chat: a user's turn); "
                   "repeatable")
    p.add_argument("--chat", action="store_true", help="talk to a fine-tuned model: prompts are user turns, "
                   "rendered by the chat template; --task asks its questions the same way")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.85)
    p.add_argument("--top_p", type=float, default=0.85)
    p.add_argument("--top_k", type=int, default=0, help="0 disables top-k filtering")
    p.add_argument("--do_sample", type=int, choices=(0, 1), default=1, help="1 samples, 0 is greedy")
    p.add_argument("--greedy", dest="do_sample", action="store_const", const=0, help="same as --do_sample 0")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda:0 where there is a GPU, else cpu)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--ppl_data", help="held-out .jsonl ({\"text\": ...} per line) to measure perplexity on")
    p.add_argument("--ppl_max_docs", type=int, default=None, help="only the first N documents")
    p.add_argument("--max_seq_len", type=int, default=512, help="truncate --ppl_data documents to this many tokens")
    p.add_argument("--task", help="multiple-choice task .jsonl (dataset/tasks/) to measure accuracy on")
    p.add_argument("--task_bos", type=int, choices=(0, 1), default=1,
                   help="1: contexts read from BOS (lm_eval's add_bos_token=True); 0: without (lm_eval's default)")
    p.add_argument("--batch_size", type=int, default=32, help="rows (context + one choice) per forward pass")
    args = p.parse_args(argv)
    if args.weight_path and args.hf_dir:
        p.error("pass --weight_path or --hf_dir, not both")
    if args.use_moe not in (None, 0, 1):
        p.error(f"--use_moe must be 0 or 1, got {args.use_moe}")
    if args.ppl_data and not Path(args.ppl_data).is_file():
        p.error(f"--ppl_data {args.ppl_data}: file not found: pass an existing .jsonl file")
    if args.task and not Path(args.task).is_file():
        p.error(f"--task {args.task}: file not found: pass an existing task .jsonl (dataset/tasks/)")
    if args.batch_size < 1:
        p.error(f"--batch_size must be at least 1, got {args.batch_size}")
    if args.ppl_max_docs is not None and args.ppl_max_docs < 1:
        p.error(f"--ppl_max_docs must be at least 1, got {args.ppl_max_docs}")
    if args.max_seq_len < 2:
        p.error(f"--max_seq_len must be at least 2 (room for BOS and EOS), got {args.max_seq_len}")
    if args.max_new_tokens < 0 or args.top_k < 0 or args.seed < 0:
        p.error("--max_new_tokens, --top_k and --seed must not be negative")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top_p must be in (0, 1] (1 turns it off), got {args.top_p}")
    if not (args.prompt or args.ppl_data or args.task or sys.stdin.isatty()):
        p.error("nothing to do: pass --prompt TEXT, --ppl_data FILE.jsonl or --task FILE.jsonl "
                "(or run in a terminal to chat)")
    return args


def chance_level(items):
    """The accuracy of guessing: the mean over items of 1 / number of choices."""
    return sum(1 / len(item.choices) for item in items) / len(items)


def tokenizer_for(args):
    """--tokenizer_path, else the exported folder's own tokenizer, else the repo's."""
    path = args.tokenizer_path
    if path is None:
        hf_dir = Path(args.hf_dir) if args.hf_dir else None
        path = hf_dir if hf_dir and (hf_dir / "tokenizer.json").is_file() else REPO_ROOT / "model"
    return load_tokenizer(path)


@report_user_errors
def main(argv=None):
    args = parse_args(argv)
    device = resolve_device(args.device)
    tokenizer = tokenizer_for(args)
    items = load_task(args.task, "--task") if args.task else None  # a bad task file fails before the model loads
    flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
    weight_path = args.weight_path
    if weight_path is None and args.hf_dir is None:
        weight_path = default_weight_path(REPO_ROOT / "out", args.hidden_size, args.use_moe)
    model, source = load_model(weight_path, args.hf_dir, **flags)
    if len(tokenizer) > model.config.vocab_size:
        raise WeightsError(f"{tokenizer.name_or_path}: tokenizer has {len(tokenizer)} tokens but the model only "
                           f"{model.config.vocab_size}: pass --tokenizer_path the tokenizer it was trained with")
    if args.ppl_data and args.max_seq_len > model.config.max_position_embeddings:
        raise UserError(f"--max_seq_len {args.max_seq_len} is longer than the context of the model in {source} "
                        f"({model.config.max_position_embeddings} positions): pass at most that")
    model.to(device)
    torch.manual_seed(args.seed)
    if args.ppl_data and is_conversations(args.ppl_data):
        docs, tokens, loss, bpb = conversation_loss(model, tokenizer, args.ppl_data, args.ppl_max_docs, args.max_seq_len)
        print(f"ppl_data={args.ppl_data} conversations={docs} reply_tokens={tokens} loss={loss:.6f} "
              f"ppl={math.exp(loss):.6f} bits_per_byte={bpb:.6f}")
    elif args.ppl_data:
        docs, tokens, loss, bpb = perplexity(model, tokenizer, args.ppl_data, args.ppl_max_docs, args.max_seq_len)
        print(f"ppl_data={args.ppl_data} docs={docs} tokens={tokens} loss={loss:.6f} ppl={math.exp(loss):.6f} "
              f"bits_per_byte={bpb:.6f}")
    for prompt in args.prompt:
        if args.chat:
            print(f"user: {prompt}\nassistant: ", end="")
            chat_reply(model, tokenizer, [{"role": "user", "content": prompt}], args)
        else:
            generate_text(model, tokenizer, prompt, args)
    if args.task:  # last, so that its line is the output's last line
        result = evaluate_task(model, encode_task(tokenizer, items, bool(args.task_bos), chat=args.chat), device,
                               batch_size=args.batch_size)
        print(f"task={args.task} items={result.n} chance={chance_level(items):.4f}")
        print(result.line())
    if not args.prompt and not args.ppl_data and not args.task:
        print(f"[{source}]")
        interactive(model, tokenizer, args)


if __name__ == "__main__":
    main()
