"""Split a JSONL corpus into train and validation files, deterministically.

    python scripts/split_corpus.py --data_path dataset/demo_pretrain.jsonl \
        --train_out out/quickstart/data/train.jsonl --val_out out/quickstart/data/val.jsonl --every 25

Every `every`-th document (the 25th, 50th, ... non-blank line) goes to the validation
file, the rest to the train file, so validation measures documents the model never
trained on. Why a stride and not a random sample or the tail: the demo corpus is
ordered by stdlib module, so a tail would be a few alphabetically-last modules (a
distribution shift, not a held-out sample), while a stride takes documents from
across the whole corpus and needs no seed to be the same on every machine.
Lines are copied byte for byte (prepare_data.py validates them later); blank lines
are dropped. Both outputs are written to temp files and renamed into place once both
are on disk (common/storage.py).
"""
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common.cli import OneLineArgumentParser  # noqa: E402
from common.errors import DataError, report_user_errors  # noqa: E402
from common.storage import AtomicFile  # noqa: E402
from dataset.lm_dataset import iter_raw_lines  # noqa: E402


def is_held_out(index, every):
    """Whether document `index` (non-blank lines counted from 0) goes to validation."""
    return index % every == every - 1


def split_corpus(data_path, train_out, val_out, every=50):
    """Write documents i with i % every == every - 1 to val_out, the others to train_out.

    Returns (train_docs, val_docs). Raises DataError when either side would be empty.
    """
    if every < 2:
        raise DataError(f"--every must be at least 2 (1 would leave nothing to train on), got {every}")
    train_out, val_out = Path(train_out), Path(val_out)
    paths = {"--train_out": train_out, "--val_out": val_out, "--data_path": Path(data_path)}
    if len({path.resolve() for path in paths.values()}) < 3:
        raise DataError(f"{', '.join(f'{flag} {path}' for flag, path in paths.items())}: the three must be different "
                        f"files (the outputs would overwrite each other or the corpus); pass other paths")
    counts = {train_out: 0, val_out: 0}
    for path in counts:
        path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicFile(train_out, "the training documents", elsewhere="pass another --train_out") as train, \
            AtomicFile(val_out, "the held-out documents", elsewhere="pass another --val_out") as val:
        for i, (_, _, raw) in enumerate(iter_raw_lines(data_path)):
            out, path = (val, val_out) if is_held_out(i, every) else (train, train_out)
            out.write(raw if raw.endswith(b"\n") else raw + b"\n")
            counts[path] += 1
        if counts[val_out] == 0:
            raise DataError(f"{data_path}: only {counts[train_out]} documents, fewer than --every {every}: "
                            f"the validation file would be empty; lower --every")
        train.close()  # both on disk before either is renamed: a full disk leaves neither in place
    return counts[train_out], counts[val_out]


@report_user_errors
def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_path", required=True, help='JSONL corpus, one {"text": ...} per line')
    p.add_argument("--train_out", required=True, help="JSONL to write the training documents to")
    p.add_argument("--val_out", required=True, help="JSONL to write the held-out documents to")
    p.add_argument("--every", type=int, default=50, help="every N-th document goes to validation (default 50)")
    args = p.parse_args(argv)
    n_train, n_val = split_corpus(args.data_path, args.train_out, args.val_out, args.every)
    print(f"split {args.data_path}: {n_train} train docs -> {args.train_out}, "
          f"{n_val} val docs (every {args.every}th) -> {args.val_out}")


if __name__ == "__main__":
    main()
