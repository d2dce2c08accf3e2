"""Is one model better than another on a multiple-choice task? Both answer the same items, so
the difference is measured item by item (a paired comparison), whose standard error is far
smaller than either score's own when the two models agree on most items:

    python scripts/compare_task.py --task dataset/tasks/minimind_sft_heldout.jsonl --chat \
        --weights out/quickstart/quickstart_128.pth out/quickstart/sft/quickstart_sft_128.pth

prints, for acc and acc_norm, the chance level, each model's score and the difference B - A
with its paired standard error (the sample standard deviation of the per-item differences / sqrt(n)) and
how many standard errors it is from 0, as key=value lines.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import report_user_errors  # noqa: E402
from dataset.lm_dataset import load_tokenizer  # noqa: E402
from model.weights import load_model  # noqa: E402
from common.cli import OneLineArgumentParser  # noqa: E402
from trainer.evaluate import choice_logprobs, encode_task, judge, load_task  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def verdicts(weight_path, items) -> list[tuple[bool, bool]]:
    """(acc, acc_norm) per item of one model, as eval_llm.py --task scores them."""
    model = load_model(weight_path)[0].float().eval()
    return [judge(item, logprobs) for item, logprobs in zip(items, choice_logprobs(model, items))]


def paired(a: list[bool], b: list[bool]) -> tuple[float, float]:
    """(mean of b - a, its standard error) over items."""
    diffs = [float(y) - float(x) for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else math.nan
    return mean, spread / math.sqrt(n)


@report_user_errors
def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, help="multiple-choice task .jsonl (dataset/tasks/)")
    p.add_argument("--weights", nargs=2, required=True, metavar=("A", "B"), help="the two models' weights")
    p.add_argument("--chat", action="store_true", help="ask the questions as chat turns (eval_llm.py --chat)")
    p.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"))
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_path)
    task = load_task(args.task, "--task")
    items = encode_task(tokenizer, task, chat=args.chat)
    chance = sum(1 / len(item.choices) for item in task) / len(task)
    a, b = (verdicts(path, items) for path in args.weights)
    for k, metric in enumerate(("acc", "acc_norm")):
        score_a, score_b = (sum(v[k] for v in vs) / len(items) for vs in (a, b))
        diff, stderr = paired([v[k] for v in a], [v[k] for v in b])
        print(f"metric={metric} items={len(items)} chance={chance:.4f} a={score_a:.4f} b={score_b:.4f} "
              f"b_minus_a={diff:+.4f} paired_stderr={stderr:.4f} z={diff / stderr if stderr else math.nan:.2f}")


if __name__ == "__main__":
    main()
