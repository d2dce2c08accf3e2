"""The out-of-distribution held-out set: real English text from another source than the demo
corpus, built offline from what every machine that runs the project has installed, never
trained on. scripts/bench/bench_quality.py scores every variant on it beside the demo
corpus's own held-out split.

    python -m dataset.ood_corpus                       # -> dataset/ood_heldout.jsonl, and its sha256
    python -m dataset.ood_corpus --out /tmp/ood.jsonl --exclude my_corpus.jsonl

The source: the long descriptions (the README each project ships as the body of its
METADATA) of the packages requirements.txt pins exactly (`name==version`; other lines are
skipped). A pinned version is the same README on every machine, whatever else the machine
has installed, so two machines build the same bytes: the sha256 printed says whether they did.
A local version label (torch's `+cpu`) is the same release and README, so it is accepted.

The documents: each README split into paragraphs (at blank lines) and paragraphs joined into
documents of at most MAX_CHARS characters (a longer paragraph is cut at a line or word end);
documents under MIN_CHARS are dropped, as the demo corpus drops short docstrings. MAX_CHARS is
about the demo corpus's mean document and keeps every document within the bench's 340 tokens.
A document is dropped where it shares a run of SHARED_WORDS words with the corpus it must not
overlap (--exclude, the demo corpus by default: text both sets hold would not be out of
distribution), or where half its runs of that length are in documents kept before it (a near
duplicate: READMEs of one vendor repeat their boilerplate). Of what is left, the DOC_COUNT
documents of smallest sha256 are written, in source order: a pick spread over all packages,
whose count is the same on every machine. Too few is a one-line DataError.
"""
import hashlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

from common.cli import OneLineArgumentParser
from common.errors import DataError, report_user_errors, storage_error
from common.storage import AtomicFile
from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus
from dataset.lm_dataset import iter_raw_lines, parse_line

OOD_CORPUS = Path(__file__).resolve().parent / "ood_heldout.jsonl"
REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"

DOC_COUNT = 200  # of about 240 documents today: room for a README that shrinks a little in a new pin
MIN_CHARS = 200
MAX_CHARS = 500
SHARED_WORDS = 8  # no 8-word run of today's set is in the demo corpus; 6 words already match phrases

_WORDS = re.compile(r"\w+")


def pinned_packages(requirements=REQUIREMENTS) -> list[tuple[str, str]]:
    """(name, version) of every `name==version` line of a requirements file, sorted by name."""
    pins = {}
    for number, line in enumerate(Path(requirements).read_text(encoding="utf-8").splitlines(), start=1):
        # Extras and environment markers change neither the release nor its README.
        name, sep, version = line.split("#", 1)[0].split(";", 1)[0].strip().partition("==")
        name, version = name.split("[", 1)[0].strip().lower(), version.strip()
        if not sep or not name or name.startswith("-"):
            continue
        if pins.setdefault(name, version) != version:
            raise DataError(f"{requirements}:{number}: {name} pinned at {pins[name]} and {version}: keep one pin")
    if not pins:
        raise DataError(f"{requirements}: no name==version line: the OOD set reads the packages it pins")
    return sorted(pins.items())


def description(name: str, version: str, requirements=REQUIREMENTS) -> str:
    """The long description of installed package `name`, which must be release `version`."""
    fix = f"pip install -r {requirements}"
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"{name}=={version} ({requirements}) is not installed, and the OOD set is built from its "
                        f"description: {fix}") from None
    if dist.version.split("+")[0] != version:
        raise DataError(f"{name} {dist.version} is installed but {requirements} pins {version}: the OOD set would "
                        f"differ from other machines': {fix}")
    meta = dist.metadata
    return meta.get_payload() or meta.get("Description") or ""


def paragraphs(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return [p.strip("\n") for p in re.split(r"\n{2,}", "\n".join(lines)) if p.strip()]


def cut(paragraph: str, max_chars: int) -> str:
    """`paragraph` cut to max_chars, at the last line end, else word end, inside that."""
    if len(paragraph) <= max_chars:
        return paragraph
    head = paragraph[:max_chars]
    for sep in ("\n", " "):
        if sep in head:
            return head.rsplit(sep, 1)[0].rstrip()
    return head


def chunk(text: str, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> list[str]:
    """Documents of whole consecutive paragraphs (each cut to max_chars), at most max_chars long."""
    docs, current = [], ""
    for paragraph in paragraphs(text):
        paragraph = cut(paragraph, max_chars)
        if current and len(current) + 2 + len(paragraph) > max_chars:
            docs.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        docs.append(current)
    return [doc for doc in docs if len(doc) >= min_chars]


def word_runs(text: str, n: int = SHARED_WORDS) -> set[tuple[str, ...]]:
    """Every run of n consecutive words, case and punctuation ignored: what "the same text" means here."""
    words = _WORDS.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def corpus_runs(path, flag: str = "--exclude") -> set[tuple[str, ...]]:
    runs = set()
    for line_number, _, raw in iter_raw_lines(path, flag):
        runs |= word_runs(parse_line(raw, path, line_number))
    return runs


def select(candidates: list[str], excluded: set, count: int) -> tuple[list[str], dict]:
    """The `count` documents of `candidates` (in source order) that the set keeps, and how many
    of each kind were dropped. Raises DataError when fewer than `count` are left."""
    kept, seen, dropped = [], set(), {"shared": 0, "near_duplicate": 0}
    for doc in candidates:
        runs = word_runs(doc)
        if runs & excluded:
            dropped["shared"] += 1
        elif (len(runs & seen) * 2 >= len(runs) > 0) or doc in kept:
            dropped["near_duplicate"] += 1
        else:
            kept.append(doc)
            seen |= runs
    if len(kept) < count:
        raise DataError(f"only {len(kept)} documents for the OOD set, {count} needed ({dropped['shared']} share text "
                        f"with the excluded corpus, {dropped['near_duplicate']} near duplicates): pass a smaller "
                        f"--count, or install requirements.txt's pins")
    chosen = set(sorted(kept, key=lambda doc: hashlib.sha256(doc.encode("utf-8")).hexdigest())[:count])
    return [doc for doc in kept if doc in chosen], dropped


def build_ood_corpus(out_path=OOD_CORPUS, exclude=DEMO_CORPUS, count: int = DOC_COUNT,
                     requirements=REQUIREMENTS) -> dict:
    """Write the OOD set to out_path atomically and return a summary with its sha256."""
    out_path = Path(out_path)
    candidates, sources = [], []
    for name, version in pinned_packages(requirements):
        candidates += chunk(description(name, version, requirements))
        sources.append(f"{name}=={version}")
    docs, dropped = select(candidates, corpus_runs(exclude), count)
    data = "".join(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs).encode("utf-8")
    what, elsewhere = "the OOD held-out set", "pass another --out"
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error(exc, what, out_path, elsewhere=elsewhere) from None
    with AtomicFile(out_path, what, needed=len(data), elsewhere=elsewhere) as out:
        out.write(data)
    return {"path": str(out_path), "documents": len(docs), "candidates": len(candidates), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "sources": sources, "exclude": str(exclude), **dropped}


def format_summary(summary: dict) -> str:
    return (f"[ood set] {summary['documents']} documents of {summary['candidates']} ({summary['shared']} sharing "
            f"text with {summary['exclude']}, {summary['near_duplicate']} near duplicates dropped), "
            f"{summary['bytes']:,} bytes, sha256 {summary['sha256']}, from {', '.join(summary['sources'])} "
            f"-> {summary['path']}")


@report_user_errors
def main(argv=None):
    p = OneLineArgumentParser(prog="python -m dataset.ood_corpus", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(OOD_CORPUS), help="the JSONL to write (default: dataset/ood_heldout.jsonl)")
    p.add_argument("--exclude", default=str(DEMO_CORPUS),
                   help="JSONL corpus whose text the set must not hold (default: the demo corpus, built if missing)")
    p.add_argument("--count", type=int, default=DOC_COUNT, help=f"documents in the set (default {DOC_COUNT})")
    p.add_argument("--requirements", default=str(REQUIREMENTS), help="the pins whose descriptions are the source")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error(f"--count must be at least 1, got {args.count}")
    if not Path(args.requirements).is_file():
        p.error(f"--requirements {args.requirements}: not found; pass the project's requirements.txt")
    if Path(args.exclude).resolve() == DEMO_CORPUS.resolve():
        ensure_demo_corpus(DEMO_CORPUS)
    print(format_summary(build_ood_corpus(args.out, args.exclude, args.count, args.requirements)))


if __name__ == "__main__":
    main(sys.argv[1:])
