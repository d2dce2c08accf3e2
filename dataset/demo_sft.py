"""The demo conversations: a small fine-tuning corpus built offline from the same standard-library
docstrings as the demo corpus (dataset/demo_corpus.py), now with the names they document.

Each documented function, class or method gives one conversation: the user asks what it
does ("What does `json.dumps` do?"), the assistant answers with the docstring's first
sentence; some go on with a follow-up turn answered by the next sentences, and some start
with a system prompt. Whole top-level modules are held out (a stable hash of the module's
name, so a module is held out on every Python version): their conversations go to
DEMO_SFT_HELDOUT, for the held-out loss and for a multiple-choice task (build_task) in the
format of dataset/tasks/, where each question's answer stands against the answers to 3
other held-out questions. The pre-training corpus holds every module's docstrings,
these too: what fine-tuning adds is the question-answer format, not the facts.
"""
import json
import random
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.storage import atomic_write_text
from dataset.demo_corpus import DEFAULT_TIMEOUT, _run_worker, discover_modules

HERE = Path(__file__).resolve().parent
DEMO_SFT = HERE / "demo_sft.jsonl"  # train_full_sft.py's default --data_path
DEMO_SFT_HELDOUT = HERE / "demo_sft_heldout.jsonl"
HOLD_OUT_EVERY = 10  # about one top-level module in 10

QUESTIONS = ("What does `{}` do?", "What is `{}` for?", "Explain `{}` in one sentence.", "Tell me what `{}` does.")
FOLLOW_UPS = ("Tell me more.", "Can you say more?", "Go on.")
SYSTEM_PROMPTS = ("You answer questions about the Python standard library.", "Answer in one sentence.",
                  "You are a concise assistant for Python programmers.")
# A builtin's docstring often opens with its signature, "name(args) -> result", before the prose.
SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")
LEADING_SIGNATURE = re.compile(r"^[\w.]+\([^)]*\)(\s*->\s*[\w.\[\], ]+?)?\s+(?=[A-Z])")  # "getkey([y, x]) Get a ..."
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(])")


def is_held_out(qualname: str) -> bool:
    return zlib.crc32(qualname.split(".")[0].encode()) % HOLD_OUT_EVERY == 0


def _pick(options, qualname: str, salt: str):
    return options[zlib.crc32(f"{salt}:{qualname}".encode()) % len(options)]


def sentences_of(doc: str) -> list[str]:
    """The prose sentences of a docstring's first paragraph (after any signature lines), then of its second."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]
    while paragraphs and SIGNATURE.match(paragraphs[0]):
        paragraphs = paragraphs[1:]
    if paragraphs:
        paragraphs[0] = LEADING_SIGNATURE.sub("", paragraphs[0])
    return [s for p in paragraphs[:2] for s in SENTENCE_END.split(p)]


def conversation_of(qualname: str, doc: str) -> list[dict] | None:
    """The conversation about one documented name, or None where its docstring gives no plain
    first sentence (a signature only, a doctest, a fragment)."""
    said = sentences_of(doc)
    if not said or not 20 <= len(said[0]) <= 200 or not said[0].endswith(".") or ">>>" in said[0]:
        return None
    turns = [{"role": "user", "content": _pick(QUESTIONS, qualname, "q").format(qualname)},
             {"role": "assistant", "content": said[0]}]
    more = " ".join(said[1:3])
    if more.endswith(".") and len(more) <= 300 and zlib.crc32(f"more:{qualname}".encode()) % 3 == 0:
        turns += [{"role": "user", "content": _pick(FOLLOW_UPS, qualname, "f")},
                  {"role": "assistant", "content": more}]
    if zlib.crc32(f"system:{qualname}".encode()) % 4 == 0:
        turns.insert(0, {"role": "system", "content": _pick(SYSTEM_PROMPTS, qualname, "s")})
    return turns


def build_demo_sft(train_path=DEMO_SFT, held_out_path=DEMO_SFT_HELDOUT, modules=None, jobs=2,
                   timeout=DEFAULT_TIMEOUT) -> dict:
    """Write both splits (atomically) and return their counts. One answer is used once: a
    docstring inherited by many methods makes one conversation, not many."""
    modules = list(modules) if modules is not None else discover_modules()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda name: _run_worker(name, timeout, named=True), modules))
    splits, answers = {False: [], True: []}, set()
    for named in results:
        for qualname, doc in named or []:
            if any(part.startswith("_") for part in qualname.split(".")):
                continue
            turns = conversation_of(qualname, doc)
            if turns is None or turns[-1]["content"] in answers or _answer(turns) in answers:
                continue
            answers.add(_answer(turns))
            splits[is_held_out(qualname)].append(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    for path, lines in ((train_path, splits[False]), (held_out_path, splits[True])):
        atomic_write_text(Path(path), "".join(lines))
    return {"train": len(splits[False]), "held_out": len(splits[True]), "modules": len(modules)}


def _answer(turns) -> str:
    """The first reply: what a question about this name is answered with."""
    return next(t["content"] for t in turns if t["role"] == "assistant")


def ensure_demo_sft(path=DEMO_SFT):
    """Return path, building both splits first if it does not exist yet (one process only)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        print(f"[demo conversations] {path} not found, building it from stdlib docstrings...")
        counts = build_demo_sft(path, path.with_name(path.stem + "_heldout.jsonl"))
        print(f"[demo conversations] {counts['train']} to train on, {counts['held_out']} held out -> {path}")
    return path


def build_task(held_out_path, out_path, n_choices: int = 4, seed: int = 0) -> int:
    """A multiple-choice item per held-out conversation: its first question as the context, its
    answer among the answers to n_choices - 1 other held-out questions. Returns the item count."""
    pairs = []
    for line in Path(held_out_path).read_text().splitlines():
        turns = json.loads(line)["conversations"]
        pairs.append((next(t["content"] for t in turns if t["role"] == "user"), _answer(turns)))
    rng = random.Random(seed)
    items = []
    for i, (question, answer) in enumerate(pairs):
        others = rng.sample([j for j in range(len(pairs)) if j != i], n_choices - 1)
        choices = [answer, *(pairs[j][1] for j in others)]
        rng.shuffle(choices)
        items.append(json.dumps({"context": question, "choices": choices, "label": choices.index(answer)},
                                ensure_ascii=False) + "\n")
    atomic_write_text(Path(out_path), "".join(items))
    return len(items)
