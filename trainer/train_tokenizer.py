"""
Train a byte-level BPE tokenizer on a JSONL corpus ({"text": ...} per line)
and save it in a form that transformers' AutoTokenizer loads offline.

Byte-level BPE with no normalizer round-trips any UTF-8 text exactly, so the
model never sees <unk> and decode(encode(x)) == x for Chinese, emoji, tabs...

    python trainer/train_tokenizer.py                   # demo corpus -> model/
    python trainer/train_tokenizer.py --data_path my.jsonl --vocab_size 8000 --out_dir out/tok
"""
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import argparse
import json
import time
from contextlib import ExitStack

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.errors import UserError, report_user_errors
from common.storage import AtomicFile
from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus
from dataset.lm_dataset import iter_jsonl_texts

# Fixed ids: the first special tokens given to the trainer get ids 0, 1, 2.
PAD_TOKEN = "<|endoftext|>"  # id 0: padding and end of a document
BOS_TOKEN = "<|im_start|>"   # id 1
EOS_TOKEN = "<|im_end|>"     # id 2
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# MiniMind's chat format (ChatML with <think> blocks), written with every tokenizer: the one
# template dataset/chat.py renders in Python for fine-tuning.
CHAT_TEMPLATE = Path(__file__).resolve().parents[1] / "model" / "chat_template.jinja"


def iter_texts(path):
    """Stream the "text" field of every non-blank line of a JSONL file: the datasets' own
    reader, so both accept the same files; raises DataError naming the file and line."""
    return (text for _, text in iter_jsonl_texts(path))


def build_tokenizer():
    """An untrained byte-level BPE tokenizer that can represent any byte sequence."""
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any normalization (NFKC, lowercasing, strip) breaks exact round trips.
    # add_prefix_space=False keeps "x" and " x" distinct and decodes back to the input.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(data_path, vocab_size, progress=True):
    """Train the tokenizer on the corpus; raises DataError on a bad line."""
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols up front, so bytes never seen in training still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(iter_texts(data_path), trainer=trainer)
    return tokenizer


def tokenizer_config():
    """tokenizer_config.json for transformers: special tokens and no automatic BOS/EOS."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        # Our datasets insert BOS/EOS themselves; adding them here would double them.
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleanup merges spaces before punctuation, which breaks exact round trips.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    return config


def save(tokenizer, out_dir):
    """Write tokenizer.json, tokenizer_config.json and the chat template into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"tokenizer.json": tokenizer.to_str(pretty=True), CHAT_TEMPLATE.name: CHAT_TEMPLATE.read_text(),
             "tokenizer_config.json": json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n"}
    with ExitStack() as stack:
        outs = [stack.enter_context(AtomicFile(out_dir / name, "the tokenizer file", "w", needed=len(text.encode()),
                                               elsewhere="pass another --out_dir")) for name, text in files.items()]
        for out, text in zip(outs, files.values()):
            out.write(text)
        for out in outs:
            out.close()  # all on disk before any is renamed: a full disk leaves the tokenizer before whole
    return out_dir


def chars_per_token(tokenizer, data_path, batch_size=256):
    """Average characters per token over the corpus (no special tokens)."""
    n_chars = n_tokens = 0
    batch = []
    for text in iter_texts(data_path):
        batch.append(text)
        if len(batch) == batch_size:
            n_chars += sum(len(t) for t in batch)
            n_tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
            batch = []
    if batch:
        n_chars += sum(len(t) for t in batch)
        n_tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
    return n_chars / max(n_tokens, 1)


@report_user_errors
def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on a JSONL corpus.")
    parser.add_argument("--data_path", type=Path, default=DEMO_CORPUS,
                        help="JSONL corpus with a \"text\" field per line (default: the demo corpus)")
    parser.add_argument("--vocab_size", type=int, default=6400, help="total vocabulary incl. special tokens")
    parser.add_argument("--out_dir", type=Path, default=REPO_ROOT / "model",
                        help="where tokenizer.json and tokenizer_config.json are written")
    parser.add_argument("--no_progress", action="store_true", help="hide the trainer's progress bar")
    args = parser.parse_args(argv)

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if args.vocab_size < min_vocab:
        parser.error(f"--vocab_size must be at least {min_vocab} (256 bytes + special tokens), got {args.vocab_size}")
    if args.data_path.resolve() == DEMO_CORPUS.resolve():
        ensure_demo_corpus(DEMO_CORPUS)
    if not args.data_path.is_file():
        raise UserError(f"--data_path {args.data_path} does not exist: pass a JSONL corpus")

    t0 = time.time()
    # The Rust progress bar only prints blank lines when not on a terminal.
    progress = not args.no_progress and sys.stderr.isatty()
    tokenizer = train(args.data_path, args.vocab_size, progress=progress)  # bad lines raise DataError
    ratio = chars_per_token(tokenizer, args.data_path)
    try:
        out_dir = save(tokenizer, args.out_dir)
    except OSError as e:
        raise UserError(f"cannot write --out_dir {args.out_dir}: {e.strerror or e}") from None
    print(f"[tokenizer] vocab {tokenizer.get_vocab_size()}, {ratio:.2f} chars/token on {args.data_path}, "
          f"{time.time() - t0:.1f}s -> {out_dir}")
    return out_dir


if __name__ == "__main__":
    main()
