"""
Build the demo corpus (dataset/demo_corpus.py): a small English pre-training corpus
made offline from the docstrings of the Python standard library; or, with --sft, the demo
conversations made from the same docstrings (dataset/demo_sft.py), and their held-out task.

    python scripts/build_demo_corpus.py                 # -> dataset/demo_pretrain.jsonl
    python scripts/build_demo_corpus.py --modules json,textwrap --out /tmp/small.jsonl
    python scripts/build_demo_corpus.py --sft           # -> dataset/demo_sft.jsonl, demo_sft_heldout.jsonl
    python scripts/build_demo_corpus.py --sft --task dataset/tasks/minimind_sft_heldout.jsonl
    python scripts/build_demo_corpus.py --task task.jsonl --held_out my_heldout.jsonl   # the task alone
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import UserError, report_user_errors  # noqa: E402
from dataset.demo_corpus import DEFAULT_TIMEOUT, DEMO_CORPUS, build_demo_corpus, format_summary  # noqa: E402
from dataset.demo_sft import DEMO_SFT, build_demo_sft, build_task  # noqa: E402


@report_user_errors
def main(argv=None):
    parser = argparse.ArgumentParser(description="Build a JSONL pre-training corpus from stdlib docstrings.")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output JSONL file (default {DEMO_CORPUS}; with --sft {DEMO_SFT}, and the held-out "
                             f"conversations beside it as *_heldout.jsonl)")
    parser.add_argument("--sft", action="store_true", help="the demo conversations instead of the corpus")
    parser.add_argument("--task", type=Path, default=None,
                        help="with --sft: also write the held-out multiple-choice task (dataset/tasks/ format) here")
    parser.add_argument("--held_out", type=Path, default=None,
                        help="with --task and no --sft: cut the task from these held-out conversations")
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
    if args.task and not (args.sft or args.held_out):
        parser.error("--task is cut from held-out conversations: pass --sft (the demo ones) or --held_out FILE")
    if args.held_out and not args.sft:
        if not args.held_out.is_file():
            parser.error(f"--held_out {args.held_out}: no such file")
        print(f"[demo conversations] {build_task(args.held_out, args.task)} task items -> {args.task}")
        return {"task": args.task}
    out = args.out or (DEMO_SFT if args.sft else DEMO_CORPUS)
    try:
        if args.sft:
            held_out = out.with_name(out.stem + "_heldout.jsonl")
            summary = build_demo_sft(out, held_out, modules=modules, jobs=args.jobs, timeout=args.timeout)
            print(f"[demo conversations] {summary['train']} to train on -> {out}, {summary['held_out']} held out "
                  f"-> {held_out} ({summary['modules']} modules)")
            if args.task:
                print(f"[demo conversations] {build_task(held_out, args.task)} task items -> {args.task}")
            return summary
        summary = build_demo_corpus(out, modules=modules, jobs=args.jobs, timeout=args.timeout)
    except OSError as e:
        raise UserError(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
