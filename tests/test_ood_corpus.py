"""dataset/ood_corpus.py: the out-of-distribution held-out set, built from the READMEs of the
packages requirements.txt pins. A real build takes a second or two, so these build it for real."""
import hashlib
import json

import pytest

from common.errors import DataError
from dataset.demo_corpus import DEMO_CORPUS
from dataset.ood_corpus import (
    DOC_COUNT, MAX_CHARS, MIN_CHARS, build_ood_corpus, chunk, corpus_runs, main, pinned_packages, select,
    word_runs,
)
from tests.support import helpers_data


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """A build without the demo corpus's text (conftest builds that corpus for every session)."""
    out = tmp_path_factory.mktemp("ood") / "ood.jsonl"
    return out, build_ood_corpus(out, exclude=DEMO_CORPUS)


def texts(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_two_builds_are_the_same_bytes_and_the_fixed_count_of_documents(first_build, tmp_path):
    out, summary = first_build
    again = build_ood_corpus(tmp_path / "again.jsonl", exclude=DEMO_CORPUS)
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()
    assert summary["sha256"] == again["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    docs = texts(out)
    assert len(docs) == summary["documents"] == DOC_COUNT < summary["candidates"]
    assert len(set(docs)) == DOC_COUNT and all(MIN_CHARS <= len(doc) <= MAX_CHARS for doc in docs)
    assert all(list(json.loads(line)) == ["text"] for line in out.read_text(encoding="utf-8").splitlines())
    # Every pinned package's README is a source, and the pick spreads over them.
    assert len(summary["sources"]) == 9 and any(s.startswith("torch==") for s in summary["sources"])
    assert any("PyTorch" in doc for doc in docs) and any("tqdm" in doc for doc in docs)


def test_no_document_shares_a_run_of_words_with_the_demo_corpus(first_build):
    out, _ = first_build
    demo = corpus_runs(DEMO_CORPUS)
    assert not [doc[:60] for doc in texts(out) if word_runs(doc) & demo]


def test_text_of_the_excluded_corpus_is_left_out_and_the_count_kept(first_build, tmp_path):
    """Three of the set's documents each lend the excluded corpus one run of 8 words, inside
    other text: they go (with any other document holding such a run: a badge's URL can be in two
    READMEs), others take their places, and the count stays."""
    out, _ = first_build
    docs = texts(out)
    lent = [docs[0], docs[DOC_COUNT // 2], docs[-1]]
    runs = [sorted(word_runs(doc))[0] for doc in lent]
    exclude = helpers_data.write_jsonl(tmp_path / "corpus.jsonl",
                                       [f"Before it, {' '.join(run)}, and after." for run in runs])
    other = build_ood_corpus(tmp_path / "other.jsonl", exclude=exclude)
    kept = texts(tmp_path / "other.jsonl")
    assert other["shared"] >= 3 and len(kept) == DOC_COUNT
    assert not set(lent) & set(kept) and not [doc for doc in kept if word_runs(doc) & set(runs)]
    assert len(set(docs) & set(kept)) >= DOC_COUNT - other["shared"]  # the others stay


def test_chunk_joins_paragraphs_up_to_the_cap_and_drops_short_documents():
    """Paragraphs of 90, 90 and 300 characters with max 200: the first two join (182 with the
    blank line), the third starts a document and is cut at its last line end inside 200; the
    tail of 40 is under min 100 and goes."""
    a, b = "a" * 90, "b" * 90
    c = "\n".join(["c" * 99, "c" * 99, "c" * 100])
    text = f"{a}\r\n\r\n{b}   \n\n\n{c}\n\n{'d' * 40}\n"
    assert chunk(text, min_chars=100, max_chars=200) == [f"{a}\n\n{b}", "c" * 99 + "\n" + "c" * 99]


def test_a_near_duplicate_goes_and_too_few_documents_is_one_line():
    words = [f"word{i}" for i in range(40)]
    doc = " ".join(words)
    near = " ".join(words[:30] + ["other"] * 10)  # 22 of its 33 runs of 8 words are doc's
    apart = " ".join(reversed(words))
    kept, dropped = select([doc, near, apart, doc], set(), count=2)
    assert kept == [doc, apart] and dropped == {"shared": 0, "near_duplicate": 2}
    with pytest.raises(DataError) as exc:
        select([doc, near, apart], set(), count=3)
    assert "only 2 documents for the OOD set, 3 needed" in str(exc.value) and "\n" not in str(exc.value)


def test_a_bad_output_path_is_one_line_and_leaves_nothing(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    corpus = helpers_data.write_jsonl(tmp_path / "corpus.jsonl", ["an unrelated document"])
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(blocker / "ood.jsonl"), "--exclude", str(corpus)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{blocker / 'ood.jsonl'}" in err and "pass another --out" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "corpus.jsonl"]


def test_only_exact_pins_are_sources_and_each_once(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# the pins\nTorch==2.13.0  # a comment\nnumpy>=2\n-r other.txt\n"
                            "tqdm[notebook]==4.70.1 ; python_version >= '3.8'\ntorch==2.13.0\n")
    assert pinned_packages(requirements) == [("torch", "2.13.0"), ("tqdm", "4.70.1")]
    requirements.write_text("tqdm==4.70.1\ntqdm==4.70.2\n")
    with pytest.raises(DataError, match=r"requirements.txt:2: tqdm pinned at 4.70.1 and 4.70.2: keep one pin"):
        pinned_packages(requirements)


@pytest.mark.parametrize("pin, says", [("tqdm==0.0.1", "tqdm 4."), ("no-such-package-here==1.0", "is not installed")])
def test_a_package_other_than_its_pin_is_one_line(pin, says, tmp_path, capsys):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"# the pins\n{pin}\n")
    corpus = helpers_data.write_jsonl(tmp_path / "corpus.jsonl", ["an unrelated document"])
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "ood.jsonl"), "--exclude", str(corpus), "--requirements", str(requirements)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert says in err and f"pip install -r {requirements}" in err and not (tmp_path / "ood.jsonl").exists()
