"""
Build the demo corpus (dataset/demo_corpus.py): a small English pre-training corpus
made offline from the docstrings of the Python standard library.

    python scripts/build_demo_corpus.py                 # -> dataset/demo_pretrain.jsonl
    python scripts/build_demo_corpus.py --modules json,textwrap --out /tmp/small.jsonl
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import UserError, report_user_errors  # noqa: E402
from dataset.demo_corpus import DEFAULT_TIMEOUT, DEMO_CORPUS, build_demo_corpus, format_summary  # noqa: E402


@report_user_errors
def main(argv=None):
    parser = argparse.ArgumentParser(description="Build a JSONL pre-training corpus from stdlib docstrings.")
    parser.add_argument("--out", type=Path, default=DEMO_CORPUS, help="output JSONL file")
    parser.add_argument("--modules", type=str, default=None,
                        help="comma-separated module names to use instead of the whole stdlib")
    parser.add_argument("--jobs", type=int, default=2, help="child processes run in parallel")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds allowed to import one module")
    args = parser.parse_args(argv)

    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    modules = None
    if args.modules is not None:
        modules = [m.strip() for m in args.modules.split(",") if m.strip()]
        if not modules:
            parser.error("--modules is empty")
    try:
        summary = build_demo_corpus(args.out, modules=modules, jobs=args.jobs, timeout=args.timeout)
    except OSError as e:
        raise UserError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
