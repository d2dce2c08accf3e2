"""How many of the repository's files and functions one optimizer step, and one checkpoint
save, run through: a reader's measure of how far they must follow the code.

Each figure is the difference of two one-process CPU runs of a tiny model (hidden 64, 2 layers,
the default data and recipe otherwise, --num_workers 0 so the dataset runs in this process),
each in a fresh interpreter under sys.setprofile: the repository functions whose call counts
differ between the two runs, and the files that hold them.

    step: 6 steps against 4, with the only save at the end of each run
    save: 4 steps saving every 2 (two saves) against only at the end (one save)

    python scripts/dev/call_paths.py              # the table
    python scripts/dev/call_paths.py --list       # and every function, per file

tests/test_imports_and_bounds.py holds the counts to their bounds.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--device", "cpu", "--log_interval", "1000", "--eval_interval", "0",
        "--val_fraction", "0"]
PRODUCT = ("common", "model", "dataset", "trainer")  # the packages a step runs through (not .venv, tests, scripts)
RUNS = {"step": ((6, 1000), (4, 1000)), "save": ((4, 2), (4, 1000))}  # (steps, save_interval): more, fewer


def count_calls(runs, work: Path) -> dict:
    """{(steps, save_interval): Counter of "file:function" calls} of each run, each in a fresh
    interpreter, all at once (the machine's cores take them side by side)."""
    jobs = {}
    for steps, save_interval in runs:
        out = work / f"calls_{steps}_{save_interval}.json"
        flags = [*TINY, "--max_steps", str(steps), "--save_interval", str(save_interval),
                 "--save_dir", str(work / f"out_{steps}_{save_interval}"),
                 "--checkpoint_dir", str(work / f"ckpt_{steps}_{save_interval}")]
        jobs[(steps, save_interval)] = (out, subprocess.Popen([sys.executable, __file__, "--child", str(out), *flags],
                                                               cwd=work, stdout=subprocess.DEVNULL,
                                                               env={**os.environ, "OMP_NUM_THREADS": "1"}))
    for run, (out, job) in jobs.items():
        if job.wait() != 0:
            raise RuntimeError(f"the run {run} failed")
    return {run: Counter(json.loads(out.read_text())) for run, (out, _) in jobs.items()}


def differing(a: Counter, b: Counter) -> dict:
    """{file: sorted functions} whose call counts differ between the two runs."""
    files = {}
    for key in sorted(set(a) | set(b)):
        if a[key] != b[key]:
            path, _, function = key.partition(":")
            files.setdefault(path, []).append(function)
    return files


def measure() -> dict:
    sys.path.insert(0, str(REPO_ROOT))
    from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus

    ensure_demo_corpus(DEMO_CORPUS)  # built before the runs, so that none counts its building
    with tempfile.TemporaryDirectory() as tmp:
        calls = count_calls({run for pair in RUNS.values() for run in pair}, Path(tmp))
        return {name: differing(calls[more], calls[fewer]) for name, (more, fewer) in RUNS.items()}


def child(out: str, flags: list):
    """Run the trainer under a profiler that counts calls of functions in the repository."""
    sys.path.insert(0, str(REPO_ROOT))
    from trainer.train_pretrain import main

    root = str(REPO_ROOT) + "/"
    counts = Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(root) and path[len(root):].split("/")[0] in PRODUCT:
                counts[f"{path[len(root):]}:{frame.f_code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        main(flags)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    Path(out).write_text(json.dumps(counts))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="also list every function, per file")
    args = parser.parse_args()
    paths = measure()
    print("| path | files | functions |\n|---|---|---|")
    for name, files in paths.items():
        print(f"| one {name} | {len(files)} | {sum(map(len, files.values()))} |")
    for name, files in paths.items():
        print(f"\n{name}: " + ", ".join(files))
        if args.list:
            for path, functions in files.items():
                print(f"  {path}: {', '.join(functions)}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        main()
