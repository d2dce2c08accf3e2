"""
Tokenize a corpus once into the flat token stream read by PackedPretrainDataset, or
(--sft) conversations into the packed file read by PackedSFTDataset.

    python scripts/prepare_data.py --data_path corpus.jsonl --out_path corpus.bin
    python scripts/prepare_data.py --sft --data_path sft_mini_512.jsonl --out_path sft.bin
    python scripts/prepare_data.py --data_path 'data/*.parquet' --out_path data_bin/   # one shard per file
    # on machine I of N, all into one shared directory:
    python scripts/prepare_data.py --data_path 'data/*.jsonl' --out_path /shared/bin --num_shards N --shard_index I

--data_path is a file, a directory or a quoted glob of .jsonl and .parquet files, taken
in sorted order. An --out_path ending in .bin gets all of them as one stream (+ its
.bin.json); any other --out_path is a directory of shards (see dataset/shards.py and
dataset/shard_output.py) with a manifest.json, written when every input file is done.

Streaming: chunks of documents go to a process pool and come back in order, and each
chunk's tokens are appended to the output as it arrives, so memory does not grow with
the corpus. Output goes to temp names renamed only once complete.
"""

import hashlib
import itertools
import os
import resource
import sys
import time
from multiprocessing import Pool
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np
from tqdm import tqdm

from common.cli import OneLineArgumentParser, at_least
from common.errors import DataError, report_user_errors, storage_error
from dataset.chat import encode_many, parse_conversation, render
from dataset.lm_dataset import iter_raw_lines, load_tokenizer
from dataset.packed_dataset import DTYPES, dtype_for_vocab
from dataset.sft_dataset import NEEDS as CONVERSATION_LINES
from dataset.sources import TEXT_SUFFIXES, decode_record, is_parquet, read_chunks, resolve_data_paths
from dataset.shard_output import AFTER_A_FAILED_WRITE, SFTWriter, ShardDirectory, StreamWriter

SHOW_BAD = 10  # how many bad locations to keep for the summary with --skip_bad_lines


# -----------------------------------------------------------------------------
# worker side: validate + tokenize one chunk of documents

_worker = {}


def init_worker(tokenizer_path, dtype, text_column):
    # The pool already keeps every core busy; tokenizers' own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _worker.update(tokenizer=tokenizer, dtype=DTYPES[dtype], text_column=text_column,
                   bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id)


def encode_chunk(task):
    """task = (file index, path, kind, records, bytes_done) ->
    (file index, bytes_done, tokens, document lengths, [bad messages])."""
    index, path, kind, records, done = task
    w = _worker
    texts, bad = [], []
    for record in records:
        try:
            texts.append(decode_record(kind, path, record, w["text_column"]))
        except DataError as e:
            bad.append(str(e))
    ids = w["tokenizer"](texts, add_special_tokens=False).input_ids if texts else []
    doc_lens = np.fromiter((len(x) + 2 for x in ids), dtype=np.int64, count=len(ids))
    docs = itertools.chain.from_iterable((w["bos"], *x, w["eos"]) for x in ids)
    tokens = np.fromiter(docs, dtype=w["dtype"], count=int(doc_lens.sum()))
    return index, done, tokens, doc_lens, bad


def encode_conversations(task):
    """task = (path, [(line number, raw line), ...]) -> each conversation's Encoded (dataset/chat.py),
    rendered as the chat template renders it, with no augmentation and uncut."""
    path, lines = task
    return encode_many(_worker["tokenizer"], [render(parse_conversation(raw, f"{path}:{line_number}"))
                                              for line_number, raw in lines])


# -----------------------------------------------------------------------------
# main process: read chunks, collect results in order, write

def all_tasks(inputs, chunk_lines, text_column):
    for index, path in inputs:
        for done, kind, records in read_chunks(path, chunk_lines, text_column):
            yield index, str(path), kind, records, done


def encode_all(tasks, num_proc, init_args, work=encode_chunk):
    """Yield the results of work(task) in input order, from a pool of num_proc processes."""
    if num_proc <= 1:  # no pool: easier to debug and profile
        init_worker(*init_args)
        yield from map(work, tasks)
        return
    # imap's feeder thread blocks once the pipe to the workers is full, so read-ahead stays
    # bounded and results come back in input order.
    with Pool(num_proc, initializer=init_worker, initargs=init_args) as pool:
        yield from pool.imap(work, tasks)


def check_input(path, text_column):
    """Fail on an empty file or a missing Parquet column now, before any tokenizing."""
    if is_parquet(path):
        next(read_chunks(path, 1, text_column))
    else:
        next(iter_raw_lines(path))


def stream_common(tokenizer, tokenizer_path) -> dict:
    """What every file of one tokenization shares (the sidecars, a shard directory's plan and
    manifest): the token dtype, the vocabulary, BOS and EOS, and the tokenizer by path and by
    content, so that a rerun with another tokenizer of the same size is caught."""
    identity = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return {"dtype": dtype_for_vocab(len(tokenizer)), "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "tokenizer": str(tokenizer_path), "tokenizer_sha256": identity}


def prepare(data_path, out_path, tokenizer_path=None, num_proc=None, skip_bad_lines=False,
            chunk_lines=1000, text_column="text", shard_tokens=0, num_shards=1, shard_index=0):
    """Tokenize data_path into out_path (a .bin, or a shard directory). Returns a dict of
    counts and figures (also written into a shard directory's manifest)."""
    t0 = time.time()
    out_path = Path(out_path)
    single = out_path.suffix == ".bin"
    if not 0 <= shard_index < num_shards:
        raise DataError(f"--shard_index {shard_index}: must be in 0..{num_shards - 1} for --num_shards {num_shards}")
    if single and (num_shards > 1 or shard_tokens):
        raise DataError(f"--out_path {out_path}: --num_shards and --shard_tokens write a directory of shards; "
                        f"pass --out_path a directory, not a .bin file")
    inputs = list(enumerate(resolve_data_paths(data_path, TEXT_SUFFIXES)))
    mine = inputs if single else inputs[shard_index::num_shards]
    for _, path in mine:
        check_input(path, text_column)

    tokenizer_path = Path(tokenizer_path) if tokenizer_path else REPO_ROOT / "model"
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise DataError(f"{tokenizer_path}: tokenizer has no BOS or EOS token; packing needs both")
    common = stream_common(tokenizer, tokenizer_path)

    if single:
        out, todo = StreamWriter(out_path, common), mine
    else:
        out = ShardDirectory(out_path, inputs, common, shard_tokens, text_column)
        todo = [(i, path) for i, path in mine if not out.is_complete(i)]
    num_proc = max(1, num_proc or os.cpu_count() or 1)
    try:
        counts = write_all(out, todo, chunk_lines, num_proc, skip_bad_lines,
                           (tokenizer_path, common["dtype"], text_column))
        out.close()
    except OSError as exc:  # a full or failing disk: the temp file goes, and one line says so
        out.abort()
        raise storage_error(exc, "the packed tokens", out_path, **AFTER_A_FAILED_WRITE) from None
    except BaseException:
        out.abort()  # a temp file, never a half-written output (a SIGKILL leaves it to the next run)
        raise
    seconds = time.time() - t0
    figures = dict(counts, seconds=round(seconds, 3), tokens_per_s=round(counts["tokens"] / seconds),
                   inputs=len(todo), inputs_skipped=len(mine) - len(todo), num_proc=num_proc,
                   shard_index=shard_index, num_shards=num_shards, **resource_figures())
    if single:
        return dict(figures, out_path=str(out_path), megabytes=out_path.stat().st_size / 1e6)
    manifest = out.finish_run(figures)
    return dict(figures, out_path=str(out_path), manifest=manifest)


def prepare_sft(data_path, out_path, tokenizer_path=None, num_proc=None, chunk_lines=1000):
    """Conversations (.jsonl files: a file, a directory or a quoted glob) into one packed SFT
    .bin; a bad line stops it, naming the line. Returns the counts."""
    t0, out_path = time.time(), Path(out_path)
    if out_path.suffix != ".bin":
        raise DataError(f"--out_path {out_path}: --sft writes one .bin (and its .bin.json, .bin.blocks); "
                        f"pass a path ending in .bin")
    inputs = resolve_data_paths(data_path, (".jsonl",))
    tokenizer_path = Path(tokenizer_path) if tokenizer_path else REPO_ROOT / "model"
    tokenizer = load_tokenizer(tokenizer_path)
    common = stream_common(tokenizer, tokenizer_path)
    tasks = ((str(path), chunk) for path in inputs for chunk in _line_chunks(path, chunk_lines))
    out = SFTWriter(out_path, common)
    try:
        for conversations in encode_all(tasks, max(1, num_proc or os.cpu_count() or 1),
                                        (tokenizer_path, common["dtype"], "text"), work=encode_conversations):
            out.write_conversations(conversations)
        out.close()
    except OSError as exc:
        out.abort()
        raise storage_error(exc, "the packed conversations", out_path, **AFTER_A_FAILED_WRITE) from None
    except BaseException:
        out.abort()
        raise
    return {"conversations": out.num_docs, "tokens": out.num_tokens, "trained_tokens": out.trained_tokens,
            "seconds": round(time.time() - t0, 3), "out_path": str(out_path)}


def _line_chunks(path, chunk_lines):
    chunk = []
    for line_number, _, raw in iter_raw_lines(path, "--data_path", CONVERSATION_LINES):
        chunk.append((line_number, raw))
        if len(chunk) == chunk_lines:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def resource_figures():
    """Peak resident memory of this process and of the largest pool worker (MB), and the CPU
    seconds of all of them: tokens per CPU second does not depend on how busy the machine is."""
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = me.ru_utime + me.ru_stime + workers.ru_utime + workers.ru_stime
    return {"peak_rss_mb": round(me.ru_maxrss / 1024, 1),  # ru_maxrss is in KiB on Linux
            "peak_worker_rss_mb": round(workers.ru_maxrss / 1024, 1), "cpu_s": round(cpu, 1)}


def write_all(out, todo, chunk_lines, num_proc, skip_bad_lines, init_args):
    """Append every chunk's tokens to its input's writer as it arrives; return the counts."""
    docs = tokens = bad_lines = 0
    first_bad = []
    sizes = {i: path.stat().st_size for i, path in todo}
    base = dict(zip(sizes, itertools.accumulate([0, *sizes.values()])))  # bytes before each input
    current = None
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="tokenizing",
               disable=None)  # no bar in logs, so an error stays one line there
    with bar:
        for index, done, chunk_tokens, doc_lens, bad in encode_all(all_tasks(todo, chunk_lines, init_args[2]),
                                                                   num_proc, init_args):
            if bad and not skip_bad_lines:
                raise DataError(bad[0])
            bad_lines += len(bad)
            first_bad += bad[:SHOW_BAD - len(first_bad)]
            if current != index:
                if current is not None:
                    out.finish_input(current)
                out.start_input(index)
                current = index
            out.write(chunk_tokens, doc_lens)
            docs += len(doc_lens)
            tokens += len(chunk_tokens)
            bar.update(base[index] + done - bar.n)
    if current is not None:
        out.finish_input(current)
    return dict(docs=docs, tokens=tokens, bad_lines=bad_lines, first_bad=first_bad)


@report_user_errors
def main(argv=None):
    parser = OneLineArgumentParser(description="Tokenize a corpus into a packed token stream or shards")
    parser.add_argument("--data_path", required=True,
                        help='a .jsonl or .parquet file, a directory of them, or a quoted glob like "data/*.jsonl"')
    parser.add_argument("--out_path", required=True,
                        help="a .bin file (one stream, + .bin.json), or a directory of shards + manifest.json")
    parser.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"))
    parser.add_argument("--text_column", default="text", help="the Parquet column that holds the text")
    parser.add_argument("--shard_tokens", type=int, default=0,
                        help="start a new shard at the first document end after this many tokens (0: one per file)")
    parser.add_argument("--num_shards", type=int, default=1, help="machines tokenizing into one shared --out_path")
    parser.add_argument("--shard_index", type=int, default=0, help="which of them this is (0-based)")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count())
    parser.add_argument("--skip_bad_lines", action="store_true",
                        help="count and skip bad lines (or Parquet rows) instead of stopping at the first")
    parser.add_argument("--chunk_lines", type=int, default=1000, help="documents per task sent to a worker")
    parser.add_argument("--sft", action="store_true",
                        help="conversations ({\"conversations\": [...]} lines) for train_full_sft.py: one .bin "
                             "of their tokens with their loss spans (.bin.blocks)")
    args = parser.parse_args(argv)
    for name, least in (("chunk_lines", 1), ("shard_tokens", 0), ("num_shards", 1)):
        if problem := at_least(least)(getattr(args, name)):
            parser.error(f"--{name} {problem}")
    if args.sft:
        stats = prepare_sft(args.data_path, args.out_path, args.tokenizer_path, args.num_proc, args.chunk_lines)
        print(f"{stats['conversations']:,} conversations, {stats['tokens']:,} tokens ({stats['trained_tokens']:,} "
              f"trained) in {stats['seconds']:.1f} s -> {stats['out_path']}")
        return
    stats = prepare(args.data_path, args.out_path, args.tokenizer_path, args.num_proc, args.skip_bad_lines,
                    args.chunk_lines, args.text_column, args.shard_tokens, args.num_shards, args.shard_index)
    print(summary(stats))


def summary(stats):
    lines = []
    if stats["bad_lines"]:
        lines.append(f"skipped {stats['bad_lines']} bad lines; the first: {stats['first_bad'][0]}")
    if stats["inputs_skipped"]:
        lines.append(f"{stats['inputs_skipped']} input file(s) already complete from an earlier run, skipped")
    lines.append(f"{stats['docs']:,} docs, {stats['tokens']:,} tokens from {stats['inputs']} files in "
                 f"{stats['seconds']:.1f} s ({stats['tokens_per_s']:,.0f} tokens/s, {stats['num_proc']} "
                 f"processes, {stats['cpu_s']:.0f} CPU s), {stats['bad_lines']} bad lines skipped; peak RSS {stats['peak_rss_mb']:.0f} MB main, "
                 f"{stats['peak_worker_rss_mb']:.0f} MB largest worker -> {stats['out_path']}")
    if "manifest" in stats:
        m = stats["manifest"]
        lines.append(f"manifest: {m['num_shards']} shards, {m['num_tokens']:,} tokens -> "
                     f"{Path(stats['out_path']) / 'manifest.json'}" if m else
                     f"machine {stats['shard_index']} of {stats['num_shards']} done; the last machine to "
                     f"finish writes manifest.json")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
