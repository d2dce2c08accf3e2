"""
Tokenize a JSONL corpus once into the flat token stream read by PackedPretrainDataset.

    python scripts/prepare_data.py --data_path corpus.jsonl --out_path corpus.bin

Writes corpus.bin (BOS + tokens + EOS per document, concatenated) and corpus.bin.json.
Streaming: chunks of lines go to a process pool and come back in order, and each chunk's
tokens are appended to the output as it arrives, so memory does not grow with the corpus.
Output goes to a temp file that replaces out_path only when everything succeeded.
"""

import argparse
import itertools
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np
from tqdm import tqdm

from dataset.lm_dataset import DataError, iter_raw_lines, load_tokenizer, open_data_file, parse_line
from dataset.packed_dataset import DTYPES, dtype_for_vocab, meta_path, write_meta

SHOW_BAD = 10  # how many bad line numbers to print with --skip_bad_lines


# -----------------------------------------------------------------------------
# worker side: validate + tokenize one chunk of lines

_worker = {}


def init_worker(tokenizer_path, data_path, dtype):
    # The pool already keeps every core busy; tokenizers' own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _worker.update(tokenizer=tokenizer, data_path=str(data_path), dtype=DTYPES[dtype],
                   bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id)


def encode_chunk(task):
    """task = (end_offset, [(line_number, raw_bytes), ...]) -> (end_offset, tokens, num_docs, bad)."""
    end_offset, lines = task
    w = _worker
    texts, bad = [], []
    for line_number, raw in lines:
        try:
            texts.append(parse_line(raw, w["data_path"], line_number))
        except DataError as e:
            bad.append((line_number, str(e)))
    ids = w["tokenizer"](texts, add_special_tokens=False).input_ids if texts else []
    count = sum(len(x) for x in ids) + 2 * len(ids)
    docs = itertools.chain.from_iterable((w["bos"], *x, w["eos"]) for x in ids)
    tokens = np.fromiter(docs, dtype=w["dtype"], count=count)
    return end_offset, tokens, len(texts), bad


# -----------------------------------------------------------------------------
# main process: read chunks, collect results in order, write

def read_chunks(data_path, chunk_lines):
    """Yield (end_offset, lines) with up to chunk_lines non-blank lines each, streaming."""
    lines, end = [], 0
    for line_number, offset, raw in iter_raw_lines(data_path):
        lines.append((line_number, raw))
        end = offset + len(raw)
        if len(lines) == chunk_lines:
            yield end, lines
            lines = []
    if lines:
        yield end, lines


def encode_all(data_path, chunk_lines, num_proc, init_args):
    """Yield encode_chunk results in file order, from a pool of num_proc processes."""
    chunks = read_chunks(data_path, chunk_lines)
    if num_proc <= 1:  # no pool: easier to debug and profile
        init_worker(*init_args)
        yield from map(encode_chunk, chunks)
        return
    # imap's feeder thread blocks once the pipe to the workers is full, so read-ahead stays
    # bounded and results come back in file order.
    with Pool(num_proc, initializer=init_worker, initargs=init_args) as pool:
        yield from pool.imap(encode_chunk, chunks)


def prepare(data_path, out_path, tokenizer_path=None, num_proc=None, skip_bad_lines=False,
            chunk_lines=1000):
    """Tokenize data_path into out_path (+ sidecar). Returns a dict of counts and timings."""
    t0 = time.time()
    data_path, out_path = Path(data_path), Path(out_path)
    tokenizer_path = Path(tokenizer_path) if tokenizer_path else REPO_ROOT / "model"
    num_proc = max(1, num_proc or os.cpu_count() or 1)
    open_data_file(data_path).close()  # fail on a bad path before paying for tokenizer + pool

    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise DataError(f"{tokenizer_path}: tokenizer has no BOS or EOS token; packing needs both")
    vocab_size = len(tokenizer)
    dtype = dtype_for_vocab(vocab_size)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    try:
        with open(tmp_path, "wb") as out:
            counts = write_stream(out, data_path, chunk_lines, num_proc, skip_bad_lines,
                                  (tokenizer_path, data_path, dtype))
        if counts["docs"] == 0:
            raise DataError(f"{data_path}: all {counts['bad_lines']} non-blank lines are bad, nothing "
                            f"to write; the first: {counts['first_bad_message']}")
        meta = write_meta(tmp_path, vocab_size=vocab_size, num_tokens=counts["tokens"],
                          num_docs=counts["docs"], bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer_path, dtype=dtype)
        os.replace(tmp_path, out_path)
        os.replace(meta_path(tmp_path), meta_path(out_path))
    finally:
        for leftover in (tmp_path, meta_path(tmp_path)):
            leftover.unlink(missing_ok=True)

    seconds = time.time() - t0
    return dict(counts, out_path=str(out_path), meta=meta, seconds=seconds,
                megabytes=out_path.stat().st_size / 1e6, tokens_per_s=counts["tokens"] / seconds)


def write_stream(out, data_path, chunk_lines, num_proc, skip_bad_lines, init_args):
    """Append every chunk's tokens to `out` as it arrives; return the counts."""
    docs = tokens = 0
    bad_lines, first_bad = 0, []
    done = 0
    bar = tqdm(total=data_path.stat().st_size, unit="B", unit_scale=True, desc="tokenizing")
    with bar:
        for end_offset, chunk_tokens, chunk_docs, bad in encode_all(data_path, chunk_lines,
                                                                    num_proc, init_args):
            if bad and not skip_bad_lines:
                raise DataError(bad[0][1])
            bad_lines += len(bad)
            first_bad += bad[:SHOW_BAD - len(first_bad)]
            chunk_tokens.tofile(out)
            docs += chunk_docs
            tokens += len(chunk_tokens)
            bar.update(end_offset - done)
            done = end_offset
    return dict(docs=docs, tokens=tokens, bad_lines=bad_lines,
                first_bad_lines=[n for n, _ in first_bad],
                first_bad_message=first_bad[0][1] if first_bad else None)


def main():
    parser = argparse.ArgumentParser(description="Tokenize a JSONL corpus into a packed token stream")
    parser.add_argument("--data_path", required=True, help='JSONL file, one {"text": ...} per line')
    parser.add_argument("--out_path", required=True, help="output .bin (a .bin.json sidecar goes next to it)")
    parser.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"))
    parser.add_argument("--num_proc", type=int, default=os.cpu_count())
    parser.add_argument("--skip_bad_lines", action="store_true",
                        help="count and skip bad lines instead of stopping at the first")
    parser.add_argument("--chunk_lines", type=int, default=1000, help="lines per task sent to a worker")
    args = parser.parse_args()
    try:
        stats = prepare(args.data_path, args.out_path, args.tokenizer_path, args.num_proc,
                        args.skip_bad_lines, args.chunk_lines)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if stats["bad_lines"]:
        shown = ", ".join(map(str, stats["first_bad_lines"]))
        print(f"skipped {stats['bad_lines']} bad lines (first: {shown}); "
              f"first problem: {stats['first_bad_message']}")
    print(f"{stats['docs']:,} docs, {stats['tokens']:,} tokens, {stats['megabytes']:.1f} MB "
          f"in {stats['seconds']:.1f} s ({stats['tokens_per_s']:,.0f} tokens/s) -> {stats['out_path']}")


if __name__ == "__main__":
    main()
