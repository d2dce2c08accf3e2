"""Build a multiple-choice task (HellaSwag style) from the held-out documents of a JSONL corpus.

    python scripts/build_eval_task.py --data_path dataset/demo_pretrain.jsonl --every 25 --seed 0 \
        --out dataset/tasks/minimind_heldout.jsonl

(the exact command that wrote the committed dataset/tasks/minimind_heldout.jsonl, on the
demo corpus of Python 3.11's standard library). The held-out documents are the quick
start's: every `every`-th one (scripts/split_corpus.py's rule); no other document is read
for an item, and an item whose passage also occurs in a training document is dropped,
so the quick start's model has never trained on any of it.

An item cuts a document at a space between two words, a few places per document:

    context  the document from its start up to the cut (the model reads it from BOS,
             as it reads a document in training), at least --min_context characters
    gold     the words right after the cut, the shortest run of whole words of at least
             --cont_chars characters on the same line
    others   3 runs of whole words from other held-out documents, each cut at a space
             within a line like the gold, their lengths within --slack characters of it

Why this shape: the quick start's model is small and has seen 1.2M tokens, so the task
asks what it can know -- which words follow this text, often names from the context --
and keeps apart what it cannot: the continuations are short (whole-passage likelihood
is mostly how common the words are, not whether they follow), of one kind (word-aligned,
one line) and of one length, so neither acc nor acc_norm can win on length or shape.
Cuts at least --stride characters apart give several items per document. Everything is
drawn from random.Random(seed): the same corpus and flags give the same file.

    python scripts/build_eval_task.py --data_path dataset/demo_pretrain.jsonl --every 25 \
        --check dataset/tasks/minimind_heldout.jsonl

checks a task file against a corpus instead (task_misfit): exit 0 when every item still
holds in this corpus's held-out split, else 1 and one line naming the first item that does
not. The demo corpus is built from the running Python's standard library, so on another
Python version it holds other documents in another order, and the committed task's items
may then come from documents the quick start trains on. scripts/quickstart.sh and
scripts/bench/bench_quality.py check before they use the committed task, and build one from the
corpus at hand when it does not hold.
"""
import json
import random
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common.cli import OneLineArgumentParser, at_least  # noqa: E402
from common.storage import atomic_write_text  # noqa: E402
from common.errors import report_user_errors  # noqa: E402
from common.errors import DataError  # noqa: E402
from dataset.lm_dataset import iter_jsonl_texts, iter_raw_lines  # noqa: E402
from scripts.split_corpus import is_held_out  # noqa: E402

N_CHOICES = 4
# A place to cut: one space with a word character on each side (not an indent, not a line break).
CUT = re.compile(r"(?<=\S) (?=\S)")


def read_split(data_path, every):
    """(held-out [(doc index, text)], training texts), doc index counting non-blank lines from 0."""
    held_out, train = [], []
    for i, (_, text) in enumerate(iter_jsonl_texts(data_path)):
        (held_out.append((i, text)) if is_held_out(i, every) else train.append(text))
    if not held_out:
        raise DataError(f"{data_path}: fewer than --every {every} documents: nothing is held out; lower --every")
    return held_out, train


def word_run(text, start, min_chars):
    """text[start:end], the shortest run of whole words from `start` with at least min_chars
    characters, or None if the line (or the text) ends first."""
    end = start + min_chars
    while end < len(text) and not text[end].isspace():
        end += 1
    run = text[start:end]
    return run if len(run) >= min_chars and "\n" not in run else None


def cut_points(text, args, rng):
    """Offsets of spaces to cut at: in reach of --min_context .. --max_context, --stride apart,
    at most --max_per_doc, from a random first one."""
    spaces = [m.start() for m in CUT.finditer(text) if args.min_context <= m.start() <= args.max_context]
    picked, last = [], -args.stride
    offset = rng.randrange(args.stride)  # not always the first space past min_context
    for p in spaces:
        if p - args.min_context >= offset and p - last >= args.stride:
            picked.append(p)
            last = p
    return picked[:args.max_per_doc]


def distractor_pool(held_out, args):
    """Every run of whole words that starts after a cut-able space: (doc index, text), by length."""
    pool = {}
    for doc, text in held_out:
        for m in CUT.finditer(text):
            run = word_run(text, m.end(), args.cont_chars)
            if run:
                pool.setdefault(len(run), []).append((doc, run))
    return pool


def pick_distractors(pool, doc, gold, args, rng):
    """N_CHOICES - 1 runs from distinct other documents, their lengths within --slack of the gold's."""
    near = [c for n in range(len(gold) - args.slack, len(gold) + args.slack + 1) for c in pool.get(n, [])]
    rng.shuffle(near)
    chosen, docs = [], {doc}
    for other, run in near:
        if other not in docs and run != gold and run not in chosen:
            chosen.append(run)
            docs.add(other)
            if len(chosen) == N_CHOICES - 1:
                return chosen
    return None


def build_items(held_out, train, args):
    rng = random.Random(args.seed)
    pool = distractor_pool(held_out, args)
    train_text = "\n".join(train)
    items = []
    for doc, text in held_out:
        for cut in cut_points(text, args, rng):
            gold = word_run(text, cut + 1, args.cont_chars)
            # The end of the context with the gold: if a training document holds it, the
            # model may have learned this very continuation.
            if gold is None or text[max(0, cut - args.overlap_chars):cut + 1] + gold in train_text:
                continue
            others = pick_distractors(pool, doc, gold, args, rng)
            if others is None:
                continue
            label = rng.randrange(N_CHOICES)
            choices = others[:label] + [gold] + others[label:]
            items.append({"context": text[:cut], "choices": choices, "label": label, "doc": doc, "cut": cut})
    return items


def task_misfit(task_path, data_path, every, overlap_chars=40):
    """Why the task at task_path is not a held-out task of the corpus at data_path, or None when
    every item holds there as build_items made it: the held-out document it names (`doc`)
    starts with its context and the gold choice right after it, no training document holds
    the passage (overlap_chars of context and the gold, build_items' rule), and every other
    choice is text of another held-out document. An item only says which document it came
    from by index, so a corpus with other documents or another order (the demo corpus built
    on another Python) fails here, rather than scoring a model on text it trained on."""
    held_out, train = read_split(data_path, every)
    docs = dict(held_out)
    train_text = "\n".join(train)
    try:
        lines = list(iter_raw_lines(task_path, "--check", "a task .jsonl written by this script"))
    except DataError as e:
        return str(e)
    for line_number, _, raw in lines:
        where = f"{task_path}:{line_number}"
        try:
            item = json.loads(raw)
            doc, context, choices, label = item["doc"], item["context"], item["choices"], item["label"]
            gold = choices[label]
            well_formed = (type(doc) is int and type(label) is int and label >= 0 and isinstance(context, str)
                           and isinstance(choices, list) and all(isinstance(c, str) for c in choices))
        except (ValueError, KeyError, TypeError, IndexError):
            well_formed = False
        if not well_formed:
            return f'{where}: not an item of build_eval_task.py (its "doc", "context", "choices" and "label")'
        text = docs.get(doc)
        if text is None:
            return (f"{where}: document {doc} is not held out in {data_path} (every {every}th of "
                    f"{len(held_out) + len(train)} documents)")
        if not text.startswith(f"{context} {gold}"):
            return f"{where}: held-out document {doc} of {data_path} does not start with the item's context and gold"
        if text[max(0, len(context) - overlap_chars):len(context) + 1] + gold in train_text:
            return f"{where}: a training document of {data_path} holds the item's passage"
        for choice in choices:
            if choice != gold and not any(choice in other for i, other in held_out if i != doc):
                return f"{where}: choice {choice!r} is text of no other held-out document of {data_path}"
    return None


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_path", required=True, help='JSONL corpus, one {"text": ...} per line')
    p.add_argument("--every", type=int, default=25, help="held-out documents: every N-th (the quick start's 25)")
    p.add_argument("--out", help="task JSONL to write")
    p.add_argument("--check", metavar="TASK", help="write nothing: exit 0 if TASK's items hold in this corpus's "
                                                   "held-out split, else 1 with a line naming the first that does not")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cont_chars", type=int, default=20, help="the gold continuation's least length in characters")
    p.add_argument("--slack", type=int, default=2, help="distractor lengths within this many characters of the gold's")
    p.add_argument("--min_context", type=int, default=40, help="least context, in characters")
    p.add_argument("--max_context", type=int, default=800, help="most context (the quick start trains on 256 tokens)")
    p.add_argument("--stride", type=int, default=30, help="least distance between two cuts of one document")
    p.add_argument("--max_per_doc", type=int, default=10)
    p.add_argument("--overlap_chars", type=int, default=40,
                   help="drop an item when this much context + the gold occurs in a training document")
    args = p.parse_args(argv)
    for name in ("cont_chars", "min_context", "stride", "max_per_doc", "every"):
        if problem := at_least(1)(getattr(args, name)):
            p.error(f"--{name} {problem}")
    if (args.out is None) == (args.check is None):
        p.error("give --out FILE (build a task) or --check TASK (check one against --data_path), one of the two")
    if args.slack < 0 or args.max_context < args.min_context:
        p.error("--slack must not be negative and --max_context not below --min_context")
    return args


@report_user_errors
def main(argv=None):
    args = parse_args(argv)
    if args.check:
        why = task_misfit(args.check, args.data_path, args.every, args.overlap_chars)
        if why:
            print(f"build_eval_task: {why}")
            sys.exit(1)
        print(f"build_eval_task: {args.check} holds in {args.data_path}: every item from its held-out documents "
              f"(every {args.every}th)")
        return
    held_out, train = read_split(args.data_path, args.every)
    items = build_items(held_out, train, args)
    if not items:
        raise DataError(f"{args.data_path}: no item could be built from {len(held_out)} held-out documents: "
                        f"lower --cont_chars or --min_context")
    atomic_write_text(Path(args.out), "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"build_eval_task: {len(items)} items from {len({i['doc'] for i in items})} of {len(held_out)} "
          f"held-out documents (every {args.every}th of {len(held_out) + len(train)}) -> {args.out}")


if __name__ == "__main__":
    main()
