"""bench_quality.py's second held-out set, out of distribution: where it comes from, each
variant's final weights (and with --ood_every its checkpoints along the run) scored on it, and
the rule that a default must not win on one held-out set and lose on the other, checked.

The set is dataset/ood_corpus.py's (the READMEs of the packages requirements.txt pins), built
without the bench's --corpus text. The score is scripts/eval_llm.py's --ppl_data, called as a
function: each document alone, BOS + text + EOS cut to the bench's --max_seq_len, so that the
bench's OOD bits per byte of a run is what `eval_llm.py --ppl_data` prints for its weights.
"""
import hashlib
import json
import re
from pathlib import Path

from dataset.ood_corpus import build_ood_corpus, format_summary
from model.weights import load_model
from scripts.bench.curves import first_reach, spread
from scripts.eval_llm import perplexity
from trainer.checkpoint import STEP_NAME, list_checkpoints

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


def ood_curve(run_dir: Path, prefix: str, val: list[dict], tokenizer, path: Path, max_seq_len: int) -> list[dict]:
    """A run's OOD curve: the weights of each checkpoint a run with --ood_every kept, scored as the
    final ones are, at the step and training seconds of that step's validation, in the keys of a
    val curve (val_loss, val_bpb: here on the OOD set). Kept in run_dir/ood_curve.json and read
    back from there; each checkpoint scored is removed but the newest, which a resume needs."""
    kept = run_dir / "ood_curve.json"
    if kept.exists():
        return json.loads(kept.read_text())
    seconds = {row["step"]: row["train_s"] for row in val}
    curve, newest_first = [], list_checkpoints(str(run_dir / "ckpt"), prefix)
    for checkpoint in reversed(newest_first):
        step = int(re.search(STEP_NAME, checkpoint)[1])
        scores = ood_score(load_model(checkpoint)[0], tokenizer, path, max_seq_len)
        curve.append({"step": step, "train_s": seconds[step], "val_loss": scores["loss"], "val_bpb": scores["bpb"]})
    kept.write_text(json.dumps(curve, indent=1))
    for checkpoint in newest_first[1:]:
        for name in (checkpoint, f"{checkpoint}.json"):
            Path(name).unlink()
    return curve


def ood_reach_lines(curves: dict, ref_times: dict) -> list[str]:
    """The table of the OOD curves: per variant, the training seconds and steps at which its OOD
    loss first falls to (a)'s final OOD loss, (a)'s training time over those seconds, and its
    final OOD bits per byte, each the mean (min-max) over the seeds, each seed against (a)'s run
    of that seed. curves: {variant: {seed: ood_curve}}; ref_times: {seed: (a)'s training seconds}."""
    ref = curves["a_minimind"]
    lines = ["| variant | time to (a)'s final OOD loss, s | (a)'s time / that time | steps to it | final OOD "
             "bits/byte |", "|---|---|---|---|---|"]
    for name, by_seed in curves.items():
        reach = {seed: first_reach(curve, ref[seed][-1]["val_loss"], "train_s") for seed, curve in by_seed.items()}
        steps = [first_reach(curve, ref[seed][-1]["val_loss"], "step") for seed, curve in by_seed.items()]
        ratio = [ref_times[seed] / t if t else None for seed, t in reach.items()]
        lines.append(f"| {name} | {spread(list(reach.values()), '.1f')} | {spread(ratio, '.1f')} | "
                     f"{spread(steps, '.1f')} | {spread([c[-1]['val_bpb'] for c in by_seed.values()], '.4f')} |")
    return lines


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
