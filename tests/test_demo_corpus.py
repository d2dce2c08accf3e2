"""Smoke tests for dataset/demo_corpus.py and scripts/build_demo_corpus.py on a handful of modules."""
import io
import json
import os
import stat
import sys
from pathlib import Path

from dataset.demo_corpus import build_demo_corpus, clean_doc, ensure_demo_corpus
from scripts.build_demo_corpus import main

MODULES = ["json", "textwrap", "heapq"]


def read_texts(path):
    texts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert set(record) == {"text"}
        texts.append(record["text"])
    return texts


def test_build_small_corpus_is_valid_and_deterministic(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    summary = build_demo_corpus(first, modules=MODULES, jobs=2, progress=False)
    build_demo_corpus(second, modules=MODULES, jobs=1, progress=False)

    texts = read_texts(first)
    assert summary["documents"] == len(texts) > 10
    assert summary["bytes"] == first.stat().st_size
    assert summary["skipped"] == []
    assert all(isinstance(t, str) and len(t) >= 200 for t in texts)
    assert len(set(texts)) == len(texts)
    assert first.read_bytes() == second.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))  # the temp file was renamed away


def test_missing_or_broken_module_is_skipped(tmp_path):
    out = tmp_path / "c.jsonl"
    # msvcrt exists in the stdlib list but cannot be imported on Linux.
    modules = ["no_such_module_xyz", "json", "msvcrt"]
    summary = build_demo_corpus(out, modules=modules, progress=False, timeout=20)
    assert summary["skipped"] == ["no_such_module_xyz", "msvcrt"]
    assert summary["documents"] == len(read_texts(out)) > 0


def test_cli_with_modules_flag(tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    main(["--modules", "textwrap", "--out", str(out), "--jobs", "1"])
    assert "documents" in capsys.readouterr().out
    assert len(read_texts(out)) > 0


def test_corpus_is_readable_by_others_under_the_umask(tmp_path):
    """Others who share the checkout or the cluster's disk read the corpus: it ends with the mode
    any file written under the process's umask gets, not a private temp file's (mkstemp's 0600)."""
    old = os.umask(0o027)
    try:
        build_demo_corpus(tmp_path / "d.jsonl", modules=["json"], progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "d.jsonl").stat().st_mode) == 0o640


def test_ensure_demo_corpus_keeps_existing_file(tmp_path):
    path = tmp_path / "existing.jsonl"
    path.write_text('{"text": "already here"}\n', encoding="utf-8")
    assert ensure_demo_corpus(path) == path
    assert path.read_text(encoding="utf-8") == '{"text": "already here"}\n'


def test_clean_doc_keeps_paragraphs_and_indentation():
    doc = "Summary line.\n\n    Body text   \n        indented code\n\n\n\n    Last paragraph.\n    "
    assert clean_doc(doc) == "Summary line.\n\nBody text\n    indented code\n\nLast paragraph."


def test_import_that_times_out_is_skipped(tmp_path):
    # No child can start and import json within a millisecond.
    summary = build_demo_corpus(tmp_path / "t.jsonl", modules=["json"], timeout=0.001, progress=False)
    assert summary["skipped"] == ["json"] and summary["documents"] == 0


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    # Under pytest stderr is a capture, as it is a file when the output is redirected:
    # no bar, so no \r updates in the log.
    build_demo_corpus(tmp_path / "a.jsonl", modules=["json"], timeout=0.001)
    assert capsys.readouterr().err == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    build_demo_corpus(tmp_path / "b.jsonl", modules=["json"], timeout=0.001)
    assert "stdlib docstrings" in terminal.getvalue()
