"""bench_quality.py's second held-out set, out of distribution: where it comes from, each
variant's final weights scored on it, and the rule that a default must not win on one held-out
set and lose on the other, checked.

The set is dataset/ood_corpus.py's (the READMEs of the packages requirements.txt pins), built
without the bench's --corpus text. The score is scripts/eval_llm.py's --ppl_data, called as a
function: each document alone, BOS + text + EOS cut to the bench's --max_seq_len, so that the
bench's OOD bits per byte of a run is what `eval_llm.py --ppl_data` prints for its weights.
"""
import hashlib
from pathlib import Path

from dataset.ood_corpus import build_ood_corpus, format_summary
from scripts.eval_llm import perplexity

REFERENCES = ("a_minimind", "b_defaults")  # MiniMind's recipe; the defaults an option must beat
SETS = ("in distribution", "out of distribution")


def ood_file(args, data: Path) -> Path:
    """--ood_data, else dataset/ood_corpus.py's set without --corpus's text, built once into `data`."""
    path = Path(args.ood_data) if args.ood_data else data / "ood.jsonl"
    if not path.exists():
        print(format_summary(build_ood_corpus(path, exclude=args.corpus)), flush=True)
    return path


def ood_line(path: Path) -> str:
    """The set's name and hash, for the results: two machines' figures compare only on the same bytes."""
    return f"OOD set: {path}, sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def ood_score(model, tokenizer, path: Path, max_seq_len: int) -> dict:
    docs, tokens, loss, bpb = perplexity(model, tokenizer, path, max_seq_len=max_seq_len)
    return {"loss": loss, "bpb": bpb, "docs": docs, "tokens": tokens}


def mean(values: list):
    """The mean of the values there are (None: a seed without final weights), or None."""
    have = [v for v in values if v is not None]
    return sum(have) / len(have) if have else None


def mixed_verdicts(finals: dict) -> list[str]:
    """The rule, checked. finals: {variant: (final bits/byte in distribution, out of distribution)}.
    One line per variant that beats a reference (REFERENCES, those that ran) on one set and loses
    on the other, else one line saying that none did. (a) is a reference, never a candidate."""
    lines, checked = [], []
    for ref in REFERENCES:
        if None in finals.get(ref, (None,)):
            continue
        checked.append(ref)
        for name, pair in finals.items():
            if name in (ref, REFERENCES[0]) or None in pair:
                continue
            wins = [x < r for x, r in zip(pair, finals[ref])]
            losses = [x > r for x, r in zip(pair, finals[ref])]
            for won, lost in ((0, 1), (1, 0)):
                if wins[won] and losses[lost]:
                    lines.append(f"bench_quality: RULE BROKEN: {name} beats {ref} {SETS[won]} and loses {SETS[lost]} "
                                 f"(final bits/byte {pair[0]:.4f}, OOD {pair[1]:.4f}; {ref}'s {finals[ref][0]:.4f}, "
                                 f"{finals[ref][1]:.4f}): a default must not win on one held-out set and lose on "
                                 f"the other")
    if checked and not lines:
        lines.append(f"bench_quality: no variant beats {' or '.join(checked)} on one held-out set and loses on "
                     f"the other")
    return lines
