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


def write_conversations(path, n=40):
    """n conversations of MiniMind's SFT format, of various lengths: every third with a system
    turn and a follow-up question."""
    lines = []
    for i in range(n):
        turns = [{"role": "user", "content": f"What is {i}?"},
                 {"role": "assistant", "content": f"It is the number {i}. " * (1 + i % 5)}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "Be brief."}, *turns,
                     {"role": "user", "content": "More?"}, {"role": "assistant", "content": "No more."}]
        lines.append(json.dumps({"conversations": turns}) + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(lines))
    return path
