"""Shared helpers for the dataset tests: sample texts and tiny corpus writers."""

import json

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "MiniMind trains small language models from scratch on a single GPU.",
    "Packing documents end to end removes almost all padding.",
    "小型语言模型也可以很有用。",
    "Numbers like 12345 and symbols like {}[]() should round-trip.",
]


def write_jsonl(path, texts):
    """Write one {"text": ...} per line; a None entry becomes a blank line."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write("\n" if text is None else json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path
