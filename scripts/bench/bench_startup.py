"""The subcommands of scripts/bench/bench_train.py that time what comes before the training steps:
`prepare` (preparing a large corpus, and the trainer's start-up on its shards) and `elastic`
(an elastic job's restart after it lost a node). Also what bench_train.py's runs share: the
tiny model's flags and a run's output folders."""
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dataset.demo_corpus import DEMO_CORPUS
from scripts.dev.elastic_agents import ElasticAgent, agreed_port, wait_until
from scripts.dev.launching import REPO_ROOT, launch, median_seconds, row, table

PREPARE = REPO_ROOT / "scripts" / "prepare_data.py"
# The tiny model of the tests, on CPU: where the time measured is start-up and rendezvous, not training.
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--val_fraction", "0", "--log_interval", "1", "--device", "cpu", "--dtype", "float32"]


def outputs(run_dir: Path) -> list:
    """The trainer's output flags for a run of its own in run_dir."""
    return ["--save_dir", run_dir / "out", "--checkpoint_dir", run_dir / "ckpt"]


# ---------------------------------------------------------------------------- elastic
def elastic_args(p):
    """How long an elastic torchrun job needs to go on after losing a node, per rendezvous setting.

    Two torchrun agents on 127.0.0.1 (--nnodes=1:2, c10d rendezvous; scripts/dev/elastic_agents.py)
    train the tiny model; after the first checkpoint of the group of 2, the second agent and its
    worker are SIGKILLed. The table splits the survivor's recovery into phases, timed from the
    kill by the arrival of its log lines: its worker's "lost a peer process" line, its agent
    seeing the failure, the new rendezvous done, the new worker's first step after the resume."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", choices=list(RDZV_CONFS), help="measure one setting")


RDZV_CONFS = {
    "torchrun defaults": "",
    "tuned (README)": "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
}
PHASES = [("peer lost line", r"error: lost a peer process"), ("agent sees failure", r"Worker group FAILED"),
          ("rendezvous done", r"Rendezvous complete for workers"), ("first step after resume", r"resumed from")]
STEP_LINE = r"^epoch \d+/\d+ step"


def recovery_phases(port: int, conf: str, steps: int, work: Path) -> dict:
    """{phase: seconds after the kill} of one elastic job that loses its second node."""
    args = [str(flag) for flag in [*TINY, "--max_steps", steps, "--save_interval", "10", "--global_batch_size", "8",
                                   "--from_resume", "1", "--dist_timeout", "60", *outputs(work)]]
    # One thread per process; the agent's rendezvous log lines (LOGLEVEL INFO) mark the phases.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CUDA_VISIBLE_DEVICES": "", "LOGLEVEL": "INFO"}
    survivor = ElasticAgent(port, args, work, env, conf)
    wait_until(lambda: survivor.first_line_after(r"Rendezvous complete", 0), 120, "first rendezvous", [survivor])
    doomed = ElasticAgent(port, args, work, env, conf)
    wait_until(lambda: "world_size=2" in survivor.output, 180, "group of 2", [survivor, doomed])
    wait_until(lambda: any((work / "ckpt").glob("*_step*.pth")), 180, "checkpoint", [survivor, doomed])
    killed_at = time.monotonic()
    doomed.kill_node()

    def step_after_resume():
        resumed = survivor.first_line_after(r"resumed from", killed_at)
        return resumed and survivor.first_line_after(STEP_LINE, resumed)
    wait_until(step_after_resume, 300, "step after the resume", [survivor])
    times, since = {}, killed_at
    for name, pattern in PHASES:
        at = survivor.first_line_after(pattern, since)
        if name == "first step after resume":
            at = survivor.first_line_after(STEP_LINE, at)
        times[name], since = at - killed_at, at
    survivor.kill_node()
    return times


def elastic(args):
    phases = {}
    for name, conf in RDZV_CONFS.items():
        if args.only and name != args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp, agreed_port() as port:
            phases[name] = recovery_phases(port, conf, args.steps, Path(tmp))
            print(f"{name}: {phases[name]}", flush=True)
    print("\nseconds after the node is killed:")
    table("--rdzv_conf", *(name for name, _ in PHASES))
    for name, times in phases.items():
        row(f"{name}: `{RDZV_CONFS[name] or '-'}`", *(f"{times[p]:.1f}" for p, _ in PHASES))


# ---------------------------------------------------------------------------- prepare
def prepare_args(p):
    """prepare_data.py on a large corpus (throughput, memory), and the trainer's start-up on its shards.

    The corpus is the demo corpus repeated into --num_files JSONL files of --file_mb MB under
    --work_dir, all deleted at the end. Each prefix of the files that --sizes names is tokenized
    by a prepare_data.py process of its own, so that its peak RSS is its own: it should not grow
    with the corpus. Start-up is the wall time of `train_pretrain.py --max_steps 1` (tiny model,
    one process) on each shard directory it wrote, beside the same on a single small .bin.
    --synthetic times start-up alone on shard directories written directly (no tokenizing): what
    the trainer pays at start depends on the shard count and sizes, not on the text."""
    p.add_argument("--work_dir", default="/tmp/bench_prepare")
    p.add_argument("--num_files", type=int, default=8)
    p.add_argument("--file_mb", type=float, default=125)
    p.add_argument("--sizes", default="2,8", help="how many of the files each prepare run takes")
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--synthetic", default="", help="SHARDS:TOKENS,... e.g. 8:247000000,1000:247000000")


def startup_seconds(data_path: Path, run_dir: Path) -> float:
    """Wall seconds of a one-step run of the tiny model on data_path, start-up and all."""
    return launch([*TINY, "--max_steps", "1", "--data_path", data_path, *outputs(run_dir)], check=True).seconds


def open_seconds(shard_dir: Path) -> float:
    """Seconds to open a shard directory and read its last window."""
    from dataset.shards import ShardedPackedDataset

    def open_and_read():
        windows = ShardedPackedDataset(shard_dir, 340)
        return windows[len(windows) - 1]
    return median_seconds(open_and_read, rounds=1, warmup=0)


def tokenize(files: list, work: Path, num_proc: int) -> dict:
    """prepare_data.py on `files` (linked into a folder of their own): its manifest's figures, and
    the trainer's start-up on the shards it wrote."""
    inputs, out = work / f"in-{len(files)}", work / f"out-{len(files)}"
    inputs.mkdir()
    for f in files:
        (inputs / f.name).symlink_to(f)
    wall = launch(["--data_path", inputs, "--out_path", out, "--num_proc", num_proc], script=PREPARE,
                  check=True).seconds
    manifest = json.loads((out / "manifest.json").read_text())
    run, mb = manifest["runs"][0], sum(f.stat().st_size for f in files) / 1e6
    figures = dict(files=len(files), mb=mb, wall=wall, tokens=manifest["num_tokens"], docs=manifest["num_docs"],
                   bad=run["bad_lines"], tokens_per_s=run["tokens_per_s"], mb_per_s=mb / run["seconds"],
                   tokens_per_cpu_s=manifest["num_tokens"] / run["cpu_s"], main_rss=run["peak_rss_mb"],
                   worker_rss=run["peak_worker_rss_mb"], shards=manifest["num_shards"])
    figures.update(startup=startup_seconds(out, work / f"run-{len(files)}"), opened=open_seconds(out))
    shutil.rmtree(out)
    return figures


def synthetic_shards(work: Path, num_shards: int, total_tokens: int) -> dict:
    from dataset.packed_dataset import write_meta
    from dataset.shards import write_manifest

    folder, rng, shards = work / f"synthetic-{num_shards}", np.random.default_rng(0), []
    per = total_tokens // num_shards
    folder.mkdir()
    common = dict(dtype="uint16", vocab_size=6400, bos_token_id=1, eos_token_id=2, tokenizer="synthetic")
    for k in range(num_shards):
        rng.integers(3, 6400, per, dtype=np.uint16).tofile(folder / f"{k:05d}-synthetic.bin")
        write_meta(folder / f"{k:05d}-synthetic.bin", num_tokens=per, num_docs=1, **common)
        shards.append({"path": f"{k:05d}-synthetic.bin", "num_tokens": per, "num_docs": 1})
    write_manifest(folder, common, shards, runs=[])
    figures = dict(shards=num_shards, tokens=per * num_shards, opened=open_seconds(folder),
                   startup=startup_seconds(folder, work / f"run-s{num_shards}"))
    shutil.rmtree(folder)
    return figures


def repeated_corpus(folder: Path, num_files: int, file_mb: float) -> list[Path]:
    """The demo corpus repeated into num_files JSONL files of about file_mb MB each."""
    folder.mkdir()
    block = DEMO_CORPUS.read_bytes()
    files = [folder / f"part-{k:03d}.jsonl" for k in range(num_files)]
    for path in files:
        with open(path, "wb") as f:
            for _ in range(max(1, round(file_mb * 1e6 / len(block)))):
                f.write(block)
    return files


def synthetic_table(args, work: Path):
    rows = [synthetic_shards(work, *map(int, spec.split(":"))) for spec in args.synthetic.split(",")]
    table("shards", "tokens", "trainer start-up to step 1", "ShardedPackedDataset open + last window")
    for r in rows:
        row(f"{r['shards']:,}", f"{r['tokens']:,}", f"{r['startup']:.1f} s", f"{r['opened'] * 1e3:.0f} ms")


def tokenize_prefixes(args, work: Path) -> tuple[list[dict], float]:
    """(the figures of each --sizes prefix of the corpus, the trainer's start-up on a 1-file .bin)."""
    files = repeated_corpus(work / "corpus", args.num_files, args.file_mb)
    launch(["--data_path", DEMO_CORPUS, "--out_path", work / "small.bin", "--num_proc", "1"], script=PREPARE,
           check=True)
    small = startup_seconds(work / "small.bin", work / "run-small")
    print(f"start-up on a 1-file .bin: {small:.1f} s", flush=True)
    rows = []
    for n in map(int, args.sizes.split(",")):
        rows.append(tokenize(files[:n], work, args.num_proc))
        print(f"done: {rows[-1]}", flush=True)  # a row at a time: a slow machine may not get to the end
    return rows, small


def prepare(args):
    work = Path(args.work_dir)
    if work.exists():
        sys.exit(f"bench_train.py prepare: error: {work} exists; pass another --work_dir or delete it")
    work.mkdir(parents=True)
    try:
        if args.synthetic:
            return synthetic_table(args, work)
        rows, small = tokenize_prefixes(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nprepare_data.py --num_proc {args.num_proc}, corpus = {DEMO_CORPUS.name} repeated, "
          f"{args.file_mb:g} MB per file")
    table("input", "files -> shards", "tokens", "docs", "bad lines", "wall s", "tokens/s", "tokens per CPU s", "MB/s",
          "peak RSS main", "peak RSS largest worker", "trainer start-up", "shards open")
    for r in sorted(rows, key=lambda r: r["mb"]):
        row(f"{r['mb']:,.0f} MB", f"{r['files']} -> {r['shards']}", f"{r['tokens']:,}", f"{r['docs']:,}", r["bad"],
            f"{r['wall']:.0f}", f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_cpu_s']:,.0f}", f"{r['mb_per_s']:.2f}",
            f"{r['main_rss']:.0f} MB", f"{r['worker_rss']:.0f} MB", f"{r['startup']:.1f} s",
            f"{r['opened'] * 1e3:.0f} ms")
    print(f"\ntrainer start-up = wall time of train_pretrain.py --max_steps 1 (python, tiny model) on the shard "
          f"directory; {small:.1f} s on a 1-file .bin. shards open = ShardedPackedDataset(dir) + its last window.")


SUBCOMMANDS = {"elastic": (elastic_args, elastic), "prepare": (prepare_args, prepare)}
