"""Time to quality: how soon does each recipe reach MiniMind's validation loss?

    python scripts/bench/bench_quality.py                      # MiniMind's shapes: hidden 256, 4 layers, seq 340, batch 8
    python scripts/bench/bench_quality.py --steps 40 --eval_every 10 --hidden_size 64 --num_hidden_layers 2   # a smoke run
    python scripts/bench/bench_quality.py --variants a_minimind,b_defaults --reuse 1 \
        --variant "muon_lr_0.04=--muon_lr 0.04" --variant "warmup_30=--warmup_steps 30"   # a sweep around (b)
    python scripts/bench/bench_quality.py --variants a_minimind,b_defaults --seeds 3 \
        --variant "no_normuon=--normuon 0"                                # each run with 3 seeds

Trains on the demo corpus with the quick start's held-out split (every 25th document,
scripts/split_corpus.py), one variant after another (with --seeds N, the variants take turns
seed after seed), one process with --threads threads each, and validates every --eval_every
steps on the same packed val.bin for every variant (the trainer validates padded runs on
packed data too), so the curves share one yardstick. The clock is the trainer's training
time (validation excluded). The runs go through scripts/dev/launching.py's launch and alternate.

    a_minimind   MiniMind's recipe, the README's line: padded JSONL, fp32, lr 5e-4, no warmup, AdamW
                 (betas 0.9,0.999) on everything with one weight decay
    b_defaults   this repo's defaults on packed .bin (no optimizer/dtype flags at all)
    c_adamw      packed .bin, AdamW with split groups, lr 3e-3, 10 warmup steps: what Muon adds
    d_bf16       b_defaults under bf16 autocast
    e_fp32       b_defaults in fp32: beside d_bf16, does bf16 cost quality at equal steps?

Each --variant NAME=FLAGS adds one more: b_defaults with those trainer flags on top.

Reports, for each variant, the training time (and the step) at which its val curve
first falls to (a)'s final val loss (interpolated between validations) and the ratio
to (a)'s, its bits per byte at (a)'s time and the downstream accuracy of its final
weights on the held-out multiple-choice task (the quick start's: the committed one in
dataset/tasks/ where its items hold in this corpus, else one built from the corpus's
held-out documents; trainer/evaluate.py; chance is 0.25); writes the table, the raw rows (JSON) and a
plot (val loss against seconds). On a shared machine seconds are noisy (s/step
shows the load each variant met); steps are not.

With --seeds N every variant trains N times, with the trainer's --seed 42, 43, ... (after the
variant's own flags, so it wins over a --seed there), each run in OUT_DIR/NAME_seedS; each seed
of a variant is measured against (a)'s run of the same seed (the same initial weights and sample
order), and the table gives, per variant, the mean and the range (min-max) over the seeds of the
time to (a)'s final loss, the final bits per byte, the bits per byte at (a)'s time and the task
accuracy. --seeds 1 (the default) is one run per variant, with the trainer's default seed.

A second held-out set, out of distribution: every variant's final weights are also scored on
--ood_data (by default the set dataset/ood_corpus.py builds offline from the READMEs of the
packages requirements.txt pins, minus any text of --corpus; its sha256 is printed, for two
machines to compare), with scripts/eval_llm.py's perplexity (each document alone, cut to
--max_seq_len tokens): its loss and bits per byte sit beside the in-distribution ones. The
trainer validates on val.bin only; with --ood_every N the runs also save a checkpoint every N
steps, the bench scores each one's weights on the OOD set after the run (then removes all but
the newest) and reports the time and steps to (a)'s final OOD loss, as for val.bin. The rule:
a default must not win on one set and lose on the other. A variant whose final bits per byte
beats (a)'s, or b_defaults', on one set and loses on the other (the means over the seeds, with
--seeds N) gets a line that says so.
"""
import json
import shlex
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus  # noqa: E402
from dataset.lm_dataset import load_tokenizer  # noqa: E402
from model.weights import load_model  # noqa: E402
from scripts.build_eval_task import main as build_task, task_misfit  # noqa: E402
from scripts.dev.launching import alternate, launch  # noqa: E402
from scripts.bench.curves import at_time, first_reach, mean, spread  # noqa: E402
from scripts.bench.held_out_ood import (  # noqa: E402
    mixed_verdicts, ood_curve, ood_file, ood_line, ood_reach_lines, ood_score,
)
from trainer.config import TrainConfig  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402
from trainer.evaluate import encode_task, evaluate_task, load_task  # noqa: E402
from trainer.config import run_prefix  # noqa: E402

DEFAULT_TASK = REPO_ROOT / "dataset" / "tasks" / "minimind_heldout.jsonl"  # cut from the demo corpus's split

# MiniMind's recipe: the README's line ("Flags") flag for flag, so that (a) is what a user who
# types that line gets. --adam_betas 0.9,0.999 is torch's default, which MiniMind's AdamW uses
# (ours is 0.9,0.95). --val_fraction 0 changes nothing here, since every variant validates on
# --val_data_path, which wins over it (trainer/data.py): it is kept for the line to be exact.
MINIMIND_RECIPE = ["--optimizer", "adamw", "--param_groups", "single", "--learning_rate", "5e-4", "--warmup_steps",
                   "0", "--lr_schedule", "cosine", "--adam_betas", "0.9,0.999", "--val_fraction", "0",
                   "--dtype", "float32", "--zero_init_outputs", "0", "--weight_decay", "0.01"]

VARIANTS = {
    "a_minimind": ("jsonl", MINIMIND_RECIPE),  # on padded JSONL, as MiniMind trains
    "b_defaults": ("bin", []),
    "c_adamw": ("bin", ["--optimizer", "adamw", "--learning_rate", "3e-3", "--warmup_steps", "10"]),
    "d_bf16": ("bin", ["--dtype", "bfloat16"]),
    "e_fp32": ("bin", ["--dtype", "float32"]),
}


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="one more variant, run after --variants: b_defaults plus these trainer flags, "
                        "e.g. 'muon_lr_0.04=--muon_lr 0.04' (repeatable)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (the same for all)")
    p.add_argument("--eval_every", type=int, default=5,
                   help="steps between validations; the defaults cross (a)'s final loss at about step 45, and a "
                        "straight line between points 25 steps apart on a falling, flattening curve puts it later")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=340)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--corpus", default=str(DEMO_CORPUS))
    p.add_argument("--out_dir", default=str(REPO_ROOT / "out" / "bench_quality"))
    p.add_argument("--task", default=None, help="multiple-choice task .jsonl scored on each variant's final "
                                                 "weights (default: the committed one on the demo corpus, else "
                                                 "one built from --corpus's held-out documents)")
    p.add_argument("--ood_data", default=None,
                   help="out-of-distribution held-out .jsonl scored on each variant's final weights (default: "
                        "dataset/ood_corpus.py's set, built into OUT_DIR/data/ood.jsonl without --corpus's text)")
    p.add_argument("--ood_every", type=int, default=0,
                   help="N > 0 (a multiple of --eval_every): also score the OOD set every N steps, from the "
                        "checkpoints the runs then save every N steps, and report each variant's time to (a)'s "
                        "final OOD loss (0: the final weights only)")
    p.add_argument("--plot", default=None, help="PNG path (default: OUT_DIR/val_loss_vs_time.png)")
    p.add_argument("--reuse", type=int, default=0, choices=[0, 1],
                   help="1: report a variant's run already in OUT_DIR (finished or stopped early) instead of training it")
    p.add_argument("--seeds", type=int, default=1,
                   help="train every variant with N seeds (the trainer's --seed 42, 43, ...) and report each "
                        "figure's mean and min-max over them (1: one run, the trainer's default seed)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    if Path(args.corpus).resolve() != DEMO_CORPUS.resolve() and not Path(args.corpus).is_file():
        p.error(f"--corpus {args.corpus}: not found; pass an existing .jsonl file (the default builds the demo's)")
    if args.ood_data and not Path(args.ood_data).is_file():
        p.error(f"--ood_data {args.ood_data}: not found; pass an existing .jsonl file (the default builds one)")
    if args.ood_every < 0 or (args.ood_every and args.ood_every % args.eval_every):
        p.error(f"--ood_every {args.ood_every}: give 0 or a multiple of --eval_every ({args.eval_every}), so that "
                f"each OOD point has its validation's training seconds")
    if "a_minimind" not in args.variants.split(","):
        p.error("--variants must include a_minimind: it is the reference")
    for extra in args.variant:
        name, sep, _ = extra.partition("=")
        if not sep or not name or name in VARIANTS or "/" in name:
            p.error(f"--variant {extra!r}: give NAME=FLAGS with a new NAME, e.g. 'muon_lr_0.04=--muon_lr 0.04'")
    return args


def variant_table(args) -> dict:
    """{name: (data kind, trainer flags)} of the variants to run, in order."""
    table = {name: VARIANTS[name] for name in args.variants.split(",")}
    for extra in args.variant:
        name, _, flags = extra.partition("=")
        table[name] = ("bin", [*VARIANTS["b_defaults"][1], *shlex.split(flags)])
    return table


def run_seeds(args) -> list[int]:
    """The trainer --seed of each run of a variant: its default, and the next ones for --seeds N."""
    first = TrainConfig().optim.seed
    return list(range(first, first + args.seeds))


def seed_run(name: str, flags: list, seed: int, args) -> tuple[str, list]:
    """(run name, trainer flags) of variant `name`'s run with `seed`: as ever for --seeds 1."""
    if args.seeds == 1:
        return name, flags
    return f"{name}_seed{seed}", [*flags, "--seed", str(seed)]


def prepare_data(corpus: Path, data: Path) -> Path:
    """The quick start's split and packing, made once."""
    if (data / "val.bin").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    if corpus.resolve() == DEMO_CORPUS.resolve():
        ensure_demo_corpus(corpus)  # built once from the standard library, as the trainer does
    scripts, quiet = REPO_ROOT / "scripts", {"TQDM_DISABLE": "1"}
    launch(["--data_path", corpus, "--every", "25", "--train_out", data / "train.jsonl", "--val_out",
            data / "val.jsonl"], script=scripts / "split_corpus.py", env=quiet, check=True)
    for side in ("train", "val"):
        launch(["--data_path", data / f"{side}.jsonl", "--out_path", data / f"{side}.bin", "--num_proc", "1"],
               script=scripts / "prepare_data.py", env=quiet, check=True)
    return data


def task_file(args, data: Path) -> Path:
    """--task, else the committed task where it was cut from this corpus, else one built like it."""
    if args.task:
        return Path(args.task)
    if Path(args.corpus).resolve() == DEMO_CORPUS.resolve():
        # The demo corpus of another Python version holds other documents: the committed
        # task's items could then be text the variants train on, so check before trusting it.
        why = task_misfit(DEFAULT_TASK, args.corpus, 25)
        if why is None:
            return DEFAULT_TASK
        print(f"bench_quality: {why}: another build of the demo corpus (it differs between Python versions); "
              f"scoring a task built from this one's own held-out documents instead", flush=True)
    task = data / "task.jsonl"
    if not task.exists():
        build_task(["--data_path", args.corpus, "--every", "25", "--out", str(task)])
    return task


def final_scores(run_dir: Path, args, items, tokenizer, ood: Path):
    """(DownstreamResult on the task, {loss, bpb, docs, tokens} on the OOD set) of a run's final
    weights, or (None, None) for a run stopped before it saved them."""
    pth = run_dir / f"{run_prefix('bench', args.hidden_size, False)}.pth"
    if not pth.exists():
        return None, None
    model, _ = load_model(pth)  # its shape from the config the trainer wrote beside it
    return evaluate_task(model, items), ood_score(model, tokenizer, ood, args.max_seq_len)


def read_val(metrics: Path) -> list[dict]:
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["kind"] == "val"]


def save_flags(args) -> list:
    """The final weights only; with --ood_every N, a checkpoint every N steps too, each kept."""
    if not args.ood_every:
        return ["--save_interval", args.steps]
    return ["--save_interval", args.ood_every, "--keep_last", args.steps // args.ood_every + 1]


def train(name, kind, flags, args, data: Path, out: Path) -> list[dict]:
    run_dir = out / name
    metrics = run_dir / f"{run_prefix('bench', args.hidden_size, False)}_metrics.jsonl"
    if args.reuse and metrics.exists() and (val := read_val(metrics)):
        print(f"[{name}] reusing {metrics}: {val[-1]['step']} steps, last val_loss {val[-1]['val_loss']:.4f}", flush=True)
        return val
    flags = ["--data_path", data / f"train.{kind}", "--val_data_path", data / "val.bin", "--hidden_size",
             args.hidden_size, "--num_hidden_layers", args.num_hidden_layers, "--max_seq_len", args.max_seq_len,
             "--batch_size", args.batch_size, "--max_steps", args.steps, "--eval_interval", args.eval_every,
             "--eval_batches", "1000", "--log_interval", args.eval_every, *save_flags(args),
             "--num_workers", "0", "--save_dir", run_dir, "--checkpoint_dir", run_dir / "ckpt",
             "--save_weight", "bench", *flags]
    print(f"[{name}] trainer/train_pretrain.py {' '.join(map(str, flags))}", flush=True)
    run = launch(flags, env={"OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}, log=out / f"{name}.log")
    if run.returncode != 0:
        sys.exit(f"error: variant {name} failed (rc {run.returncode}); see {run.log}")
    val = read_val(metrics)
    print(f"[{name}] {len(val)} val points, final val_loss {val[-1]['val_loss']:.4f}, "
          f"{val[-1]['train_s']:.0f} s training ({run.seconds:.0f} s with start-up and validation)", flush=True)
    return val


def report(curves: dict, args, accuracy: dict | None = None, ood: dict | None = None) -> list[str]:
    """The table of --seeds 1. accuracy: {variant: DownstreamResult or None}; ood: {variant: the
    OOD scores of final_scores, or None}."""
    ref = curves["a_minimind"]
    target, t_ref = ref[-1]["val_loss"], ref[-1]["train_s"]
    bpb_ref = ref[-1]["val_bpb"]
    lines = [f"bench_quality: hidden {args.hidden_size} x {args.num_hidden_layers} layers, seq {args.max_seq_len}, "
             f"batch {args.batch_size}, {args.steps} steps per variant, {args.threads} threads, val every "
             f"{args.eval_every} steps on the held-out val.bin; (a)'s final val loss {target:.4f} at {t_ref:.0f} s", "",
             "| variant | steps run | s/step | last val loss | last bits/byte | OOD bits/byte, final | vs (a) "
             "| time to (a)'s final loss | vs (a) | steps to it | vs (a) | bits/byte at (a)'s time | vs (a) "
             "| task acc (chance 0.25) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ood = ood or {}
    ref_ood = (ood.get("a_minimind") or {}).get("bpb")
    for name, val in curves.items():
        t, steps = first_reach(val, target, "train_s"), first_reach(val, target, "step")
        bpb = at_time(val, t_ref, "val_bpb")
        reach = f"{t:.0f} s | 1/{t_ref / t:.1f}" if t else "not reached | -"
        reach_steps = f"{steps:.0f} | 1/{args.steps / steps:.1f}" if steps else "- | -"
        acc = (accuracy or {}).get(name)
        acc_cell = f"{acc.acc:.3f} ± {acc.acc_stderr:.3f}" if acc else "-"
        out = (ood.get(name) or {}).get("bpb")
        ood_vs = f"{(out / ref_ood - 1) * 100:+.1f}%" if out is not None and ref_ood else "-"
        ood_cell = "- | -" if out is None else f"{out:.4f} | {ood_vs}"
        lines.append(f"| {name} | {val[-1]['step']} | {val[-1]['train_s'] / val[-1]['step']:.2f} | {val[-1]['val_loss']:.4f} | "
                     f"{val[-1]['val_bpb']:.4f} | {ood_cell} | {reach} | {reach_steps} | {bpb:.4f} | "
                     f"{(bpb / bpb_ref - 1) * 100:+.1f}% | {acc_cell} |")
    return lines + ["", *mixed_verdicts({name: (val[-1]["val_bpb"], (ood.get(name) or {}).get("bpb"))
                                         for name, val in curves.items()})]


def report_seeds(runs: dict, args, accuracy: dict | None = None, ood: dict | None = None) -> list[str]:
    """The table of --seeds N. runs: {variant: {seed: val curve}}; accuracy: {variant: {seed:
    DownstreamResult or None}}; ood: {variant: {seed: final_scores's OOD scores or None}}. Each
    seed of a variant is measured against (a)'s run of that seed."""
    ref = runs["a_minimind"]
    seeds = list(ref)
    lines = [f"bench_quality: hidden {args.hidden_size} x {args.num_hidden_layers} layers, seq {args.max_seq_len}, "
             f"batch {args.batch_size}, {args.steps} steps per run, {args.threads} threads, val every "
             f"{args.eval_every} steps on the held-out val.bin; {len(seeds)} seeds per variant (--seed "
             f"{seeds[0]}-{seeds[-1]}), each against (a)'s run of the same seed; every cell is the mean "
             f"(min-max) over the seeds, and 'k of N' says only k seeds got there", "",
             "| variant | time to (a)'s final loss, s | steps to it | final bits/byte | OOD bits/byte, final "
             "| bits/byte at (a)'s time | task acc (chance 0.25) |", "|---|---|---|---|---|---|---|"]
    means = {}  # {variant: (mean final bits/byte, mean OOD bits/byte)}, for the rule
    for name, by_seed in runs.items():
        reach, steps, final, final_ood, at_ref, acc = [], [], [], [], [], []
        for seed, val in by_seed.items():
            target, t_ref = ref[seed][-1]["val_loss"], ref[seed][-1]["train_s"]
            reach.append(first_reach(val, target, "train_s"))
            steps.append(first_reach(val, target, "step"))
            final.append(val[-1]["val_bpb"])
            at_ref.append(at_time(val, t_ref, "val_bpb"))
            result = (accuracy or {}).get(name, {}).get(seed)
            acc.append(result.acc if result else None)
            final_ood.append(((ood or {}).get(name, {}).get(seed) or {}).get("bpb"))
        lines.append(f"| {name} | {spread(reach, '.1f')} | {spread(steps, '.1f')} | {spread(final, '.4f')} | "
                     f"{spread(final_ood, '.4f')} | {spread(at_ref, '.4f')} | {spread(acc, '.3f')} |")
        means[name] = (mean(final), mean(final_ood))
    return lines + ["", *mixed_verdicts(means)]


def plot(runs: dict, path: Path, title: str):
    """runs: {variant: [val curve of each seed]}, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, vals) in enumerate(runs.items()):
        for j, val in enumerate(vals):
            ax.plot([r["train_s"] for r in val], [r["val_loss"] for r in val], marker="o", ms=3, color=f"C{i}",
                    label=name if j == 0 else None)
    finals = [val[-1]["val_loss"] for val in runs["a_minimind"]]
    label = "(a)'s final val loss" + (" (mean over seeds)" if len(finals) > 1 else "")
    ax.axhline(sum(finals) / len(finals), color="gray", lw=0.8, ls="--", label=label)
    ax.set(xlabel="training seconds (validation excluded)", ylabel="validation loss (held-out val.bin)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(Path(args.corpus), out / "data")
    ood = ood_file(args, data)  # before training: a missing pin stops the bench now, not after an hour
    variants = variant_table(args)
    runs = {name: {} for name in variants}  # {variant: {seed: val curve}}
    names = {name: {} for name in variants}  # {variant: {seed: its run's name}}
    seeds = {name: iter(run_seeds(args)) for name in variants}

    def train_next_seed(name):
        kind, flags = variants[name]
        seed = next(seeds[name])
        names[name][seed], run_flags = seed_run(name, flags, seed, args)
        runs[name][seed] = train(names[name][seed], kind, run_flags, args, data, out)
    # Seed after seed, the variants take turns: a slow moment of the machine falls on all of them alike.
    alternate({name: lambda name=name: train_next_seed(name) for name in variants}, rounds=args.seeds)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(REPO_ROOT / "model")
    items = encode_task(tokenizer, load_task(task_file(args, data)))
    scores = {name: {seed: final_scores(out / run, args, items, tokenizer, ood) for seed, run in by_seed.items()}
              for name, by_seed in names.items()}
    accuracy = {name: {seed: acc for seed, (acc, _) in by_seed.items()} for name, by_seed in scores.items()}
    ood_scores = {name: {seed: on_ood for seed, (_, on_ood) in by_seed.items()} for name, by_seed in scores.items()}
    if args.seeds == 1:  # the single-seed table and files, as they were
        curves = {name: next(iter(by_seed.values())) for name, by_seed in runs.items()}
        accuracy = {name: next(iter(by_seed.values())) for name, by_seed in accuracy.items()}
        ood_scores = {name: next(iter(by_seed.values())) for name, by_seed in ood_scores.items()}
        lines = report(curves, args, accuracy, ood_scores)
        raw = curves, {name: acc and vars(acc) for name, acc in accuracy.items()}
    else:
        lines = report_seeds(runs, args, accuracy, ood_scores)
        raw = runs, {name: {seed: acc and vars(acc) for seed, acc in by_seed.items()}
                     for name, by_seed in accuracy.items()}
    if args.ood_every:
        prefix = run_prefix("bench", args.hidden_size, False)
        curves = {name: {seed: ood_curve(out / run, prefix, runs[name][seed], tokenizer, ood, args.max_seq_len)
                         for seed, run in by_seed.items()} for name, by_seed in names.items()}
        sparse = [names[name][seed] for name, by_seed in curves.items() for seed, curve in by_seed.items()
                  if len(curve) < args.steps // args.ood_every]
        if sparse:  # reused runs, trained without --ood_every or with a larger one
            print(f"bench_quality: {', '.join(sparse)}: fewer OOD points than --ood_every {args.ood_every} gives "
                  f"(trained without it, or with a larger N); run them again without --reuse", flush=True)
        lines += ["", f"Out of distribution, scored every {args.ood_every} steps:", "",
                  *ood_reach_lines(curves, {seed: val[-1]["train_s"] for seed, val in runs["a_minimind"].items()})]
        (out / "ood_curves.json").write_text(json.dumps(curves, indent=1))
    lines.append(ood_line(ood))
    print("\n".join(lines))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(raw[0], indent=1))
    (out / "accuracy.json").write_text(json.dumps(raw[1], indent=1))
    (out / "ood.json").write_text(json.dumps(ood_scores, indent=1))
    png = Path(args.plot) if args.plot else out / "val_loss_vs_time.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot({name: list(by_seed.values()) for name, by_seed in runs.items()}, png,
         f"demo corpus, hidden {args.hidden_size} x {args.num_hidden_layers}, {args.threads} CPU threads")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
