"""Tests for the committed tokenizer in model/ and for trainer/train_tokenizer.py."""
import json
import random

import pytest
from transformers import AutoTokenizer

from trainer.train_tokenizer import iter_texts, main as train_main

from tests.support import REPO_ROOT

MODEL_DIR = REPO_ROOT / "model"

SAMPLES = [
    "",
    "hello world",
    "Hello, World! The quick brown fox jumps over the lazy dog.",
    "你好，世界",
    "👍🏽🚀 emoji with skin tone and 👨‍👩‍👧 a ZWJ family",
    "tabs\tand\t\tmore tabs",
    "  two leading spaces, three trailing   ",
    "line one\nline two\n\n\nafter blank lines\r\nwindows line\n",
    "control chars \x00\x01\x07\x1b[0m\x7f end",
    "mixed 中文 and English, café, naïve, Ελληνικά, русский, עברית, العربية",
    "def f(x):\n    return x ** 2  # comment\n",
    "don 't , spaces before punctuation . ?",
    "\u00a0non-breaking\u200bzero-width\ufeffbom",
    "literal special tokens <|im_start|>user\nhi<|im_end|><|endoftext|>",
]


def random_unicode(rng, n):
    """Random text over a broad slice of Unicode (no lone surrogates)."""
    chars = []
    for _ in range(n):
        cp = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x7FF),
                         rng.randint(0x800, 0xD7FF), rng.randint(0x10000, 0x1FAFF)])
        chars.append(chr(cp))
    return "".join(chars)


def test_special_token_ids(tokenizer):
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_vocab_size(tokenizer):
    assert len(tokenizer) == 6400


def test_config_disables_space_cleanup_and_auto_bos_eos():
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["clean_up_tokenization_spaces"] is False
    assert config["add_bos_token"] is False and config["add_eos_token"] is False


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_round_trip_random_unicode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        text = random_unicode(rng, rng.randint(1, 80))
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_no_special_tokens_added(tokenizer):
    text = "plain text, no BOS or EOS"
    plain = tokenizer(text)["input_ids"]
    assert plain == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not {0, 1, 2} & set(plain)


def test_chat_template(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           tokenize=False, add_generation_prompt=True)
    # MiniMind's template: the model answers after an empty thinking block (dataset/chat.py).
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_train_on_tiny_corpus(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    texts = [f"Document {i}: the tokenizer learns merges from repeated words, 你好 {i}." for i in range(200)]
    write_jsonl(corpus, [{"text": t} for t in texts])
    with open(corpus, "a", encoding="utf-8") as f:
        f.write("\n   \n")  # blank lines are skipped
    out_dir = tmp_path / "tok"
    train_main(["--data_path", str(corpus), "--vocab_size", "300", "--out_dir", str(out_dir), "--no_progress"])

    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    assert len(tok) == 300
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.chat_template == (REPO_ROOT / "model" / "chat_template.jinja").read_text()  # the one template
    for text in SAMPLES:
        assert tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"text": 3}\n', "bad.jsonl:2:"),
    ('{"text": "fine"}\n\n{not json\n', "bad.jsonl:3:"),
])
def test_bad_line_reports_file_and_line(tmp_path, capsys, content, message):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        train_main(["--data_path", str(corpus), "--vocab_size", "300", "--out_dir", str(tmp_path / "tok")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "tok").exists()


def test_corpus_with_a_byte_order_mark_trains_like_the_datasets_read_it(tmp_path):
    """The tokenizer trainer reads JSONL with the datasets' reader: a UTF-8 BOM on line 1
    (Windows editors write one) is accepted by both, and is not part of the text."""
    corpus = tmp_path / "bom.jsonl"
    write_jsonl(corpus, [{"text": f"line {i} with some words"} for i in range(50)])
    corpus.write_bytes(b"\xef\xbb\xbf" + corpus.read_bytes())
    assert next(iter_texts(corpus)) == "line 0 with some words"
    train_main(["--data_path", str(corpus), "--vocab_size", "300", "--out_dir", str(tmp_path / "tok"), "--no_progress"])
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
