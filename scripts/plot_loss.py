"""Plot training curves from the trainer's metrics files into one PNG.

    python scripts/plot_loss.py                                   # every out/*_metrics.jsonl
    python scripts/plot_loss.py --metrics out/a_metrics.jsonl out/b_metrics.jsonl --out cmp.png

Panels: train and val loss vs step, the same vs tokens seen, and the learning rate
vs step. Several runs are overlaid; each is labelled with its file's stem.
"""
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only; works without a display
import matplotlib.pyplot as plt  # noqa: E402

from common.errors import UserError, report_user_errors  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402


class MetricsError(UserError, ValueError):
    """str(e) is one line naming the file and what to do."""


def read_metrics(path):
    """(train rows, val rows) of one metrics .jsonl; unknown kinds are skipped."""
    train, val = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):
                    break  # the trainer is writing this very line right now
                raise MetricsError(f"{path}:{line_no}: not valid JSON ({e.msg}): is this a metrics file?") from None
            if row.get("kind") == "train":
                train.append(row)
            elif row.get("kind") == "val":
                val.append(row)
    return train, val


def series(rows, x_key, y_key):
    """xs, ys of the rows that have both keys with finite values (a diverged loss is NaN)."""
    points = [(r[x_key], r[y_key]) for r in rows
              if isinstance(r.get(x_key), (int, float)) and isinstance(r.get(y_key), (int, float))
              and math.isfinite(r[y_key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs, out_path):
    """runs: {label: (train rows, val rows)}. Writes one PNG with three panels."""
    fig, (ax_step, ax_tokens, ax_lr) = plt.subplots(1, 3, figsize=(18, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, (train, val)) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        for ax, x_key in ((ax_step, "step"), (ax_tokens, "tokens_seen")):
            ax.plot(*series(train, x_key, "loss"), color=color, lw=1, alpha=0.8, label=f"{label} train")
            xs, ys = series(val, x_key, "val_loss")
            if xs:
                ax.plot(xs, ys, color=color, lw=2, ls="--", marker="o", ms=3, label=f"{label} val")
        ax_lr.plot(*series(train, "step", "lr"), color=color, label=label)
    ax_step.set(title="loss vs step", xlabel="optimizer step", ylabel="loss")
    ax_tokens.set(title="loss vs tokens seen", xlabel="tokens seen", ylabel="loss")
    ax_lr.set(title="learning rate", xlabel="optimizer step", ylabel="lr")
    for ax in (ax_step, ax_tokens, ax_lr):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def find_metrics(save_dir, metrics):
    if metrics:
        missing = [m for m in metrics if not Path(m).is_file()]
        if missing:
            raise MetricsError(f"{missing[0]}: not found: pass --metrics an existing *_metrics.jsonl file")
        return [Path(m) for m in metrics]
    found = sorted(Path(save_dir).glob("*_metrics.jsonl"))
    if not found:
        raise MetricsError(f"{save_dir}: no *_metrics.jsonl there: pass --save_dir the trainer's --save_dir, "
                           f"or --metrics FILE")
    return found


@report_user_errors
def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save_dir", default=str(REPO_ROOT / "out"), help="where to look for *_metrics.jsonl")
    p.add_argument("--metrics", nargs="+", help="metrics files to plot (default: all in --save_dir)")
    p.add_argument("--out", help="PNG to write (default: {save_dir}/loss.png)")
    args = p.parse_args(argv)
    try:
        files = find_metrics(args.save_dir, args.metrics)
        runs = {}
        for file in files:
            train, val = read_metrics(file)
            if not (train or val):
                raise MetricsError(f"{file}: no train or val rows: is this a metrics file?")
            runs[file.stem if file.stem not in runs else str(file)] = (train, val)
    except OSError as e:
        raise MetricsError(str(e)) from None
    out = Path(args.out) if args.out else Path(args.save_dir) / "loss.png"
    plot_runs(runs, out)
    print(out)


if __name__ == "__main__":
    main()
