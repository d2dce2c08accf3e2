"""The loss a model gets without using any context: the unigram baseline.

    python scripts/unigram_baseline.py --train_bin train.bin --val_bin val.bin

Counts every token of the packed training stream (scripts/prepare_data.py output),
smooths the counts with add-one over the whole vocabulary (so a token never seen in
training still gets a finite cost), and prints the mean cross-entropy in nats of the
validation stream's tokens under that distribution. A language model whose val_loss
is not clearly below this number has learned token frequencies and nothing more.

The targets are the ones the trainer's packed val_loss scores: every token of the
validation stream but the first (BOS and EOS included), so the two numbers compare
directly. Reported for the train stream too (its own counts: a lower bound for a
unigram model, and a check that train and val are alike).
"""
import argparse
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from common.errors import DataError, report_user_errors  # noqa: E402
from dataset.packed_dataset import DTYPES, read_meta  # noqa: E402


def load_stream(bin_path):
    """(tokens, meta) of a packed .bin, its sidecar checked."""
    meta = read_meta(bin_path)
    return np.fromfile(bin_path, dtype=DTYPES[meta["dtype"]]), meta


def unigram_log_probs(train_tokens, vocab_size):
    """log p(token) with add-one smoothing: (count + 1) / (N + V)."""
    counts = np.bincount(train_tokens.astype(np.int64), minlength=vocab_size).astype(np.float64)
    if len(counts) > vocab_size:
        raise DataError(f"train stream has token id {len(counts) - 1} >= vocab_size {vocab_size}")
    return np.log(counts + 1) - np.log(counts.sum() + vocab_size)


def cross_entropy(log_probs, tokens):
    """Mean -log p over tokens[1:] (the first token of a stream is never a target)."""
    targets = tokens[1:].astype(np.int64)
    if len(targets) == 0:
        raise DataError("stream has fewer than 2 tokens: nothing to score")
    return float(-log_probs[targets].mean())


def unigram_baseline(train_bin, val_bin):
    """{"train": nats, "val": nats, "vocab_size": V, "train_tokens": N, "val_tokens": M}."""
    train, train_meta = load_stream(train_bin)
    val, val_meta = load_stream(val_bin)
    if train_meta["vocab_size"] != val_meta["vocab_size"]:
        raise DataError(f"{train_bin} and {val_bin} were tokenized with different vocabularies "
                        f"({train_meta['vocab_size']} vs {val_meta['vocab_size']} tokens)")
    log_probs = unigram_log_probs(train, train_meta["vocab_size"])
    return {"train": cross_entropy(log_probs, train), "val": cross_entropy(log_probs, val),
            "vocab_size": train_meta["vocab_size"], "train_tokens": len(train), "val_tokens": len(val)}


@report_user_errors
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train_bin", required=True, help="packed training stream (.bin from prepare_data.py)")
    p.add_argument("--val_bin", required=True, help="packed validation stream (.bin from prepare_data.py)")
    args = p.parse_args(argv)
    r = unigram_baseline(args.train_bin, args.val_bin)
    # One greppable line in eval_llm.py's key=value style; quickstart.sh reads its loss= field.
    print(f"unigram_baseline train={args.train_bin} val={args.val_bin} loss={r['val']:.4f} nats "
          f"(ppl={math.exp(r['val']):.2f})")
    print(f"  vocab {r['vocab_size']}, add-one smoothing, {r['train_tokens']:,} train / {r['val_tokens']:,} "
          f"val tokens; the train stream under its own counts: {r['train']:.4f} nats")

if __name__ == "__main__":
    main()
