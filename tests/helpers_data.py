"""Shared helpers for the dataset tests: a tokenizer to test with and tiny corpus writers."""

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_TOKENIZER = REPO_ROOT / "model"

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "MiniMind trains small language models from scratch on a single GPU.",
    "Packing documents end to end removes almost all padding.",
    "小型语言模型也可以很有用。",
    "Numbers like 12345 and symbols like {}[]() should round-trip.",
]


def tokenizer_dir(tmp_dir):
    """
    The repo's tokenizer once model/tokenizer.json exists; until then a tiny byte-level BPE
    with the same special tokens (pad=0, bos=1, eos=2), saved to tmp_dir so that
    AutoTokenizer.from_pretrained (and prepare_data.py) can load it the same way.
    """
    if (REPO_TOKENIZER / "tokenizer.json").exists():
        return REPO_TOKENIZER
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLE_TEXTS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], unk_token=specials[0],
                                   bos_token=specials[1], eos_token=specials[2])
    fast.save_pretrained(tmp_dir)
    return Path(tmp_dir)


def write_jsonl(path, texts):
    """Write one {"text": ...} per line; a None entry becomes a blank line."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write("\n" if text is None else json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path
