"""trainer/evaluate.py (multiple-choice accuracy with our model), scripts/build_eval_task.py
and the committed task under dataset/tasks/, against hand computations and lm-evaluation-harness."""
import json
import math
import re

import pytest
import torch

from common.errors import DataError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights import load_model
from scripts.build_eval_task import main as build_main, task_misfit
from scripts.convert_model import export_native, save_pth
from scripts.eval_llm import main as eval_main
from tests.support import REPO_ROOT
from scripts.split_corpus import is_held_out
from tests.support import helpers_data
from tests.support.assertions import assert_clean_exit
from tests.support.jobs import JobSpec, run_all
from tests.support.run_outputs import latest_checkpoint, out_args, read_metrics
from tests.support.tiny import CLI_FLAGS, FLAGS, TINY, ensure_demo_corpus, train_tiny
from trainer.evaluate import (
    DownstreamResult, EncodedItem, TaskItem, choice_logprobs, count_correct, encode_item, encode_task,
    evaluate_task, load_task, shard,
)

TASK_DIR = REPO_ROOT / "dataset" / "tasks"
TASK = TASK_DIR / "minimind_heldout.jsonl"
SFT_TASK = TASK_DIR / "minimind_sft_heldout.jsonl"  # the demo conversations' held-out task
RESULT_LINE = re.compile(r"acc=(\S+) acc_norm=(\S+) acc_stderr=(\S+) acc_norm_stderr=(\S+)")


class Bigram(torch.nn.Module):
    """A model whose next-token distribution depends on the current token only:
    P(next | prev) = PROBS[prev], so every log-likelihood is a sum of logs by hand."""

    PROBS = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1],    # after 0
                          [0.2, 0.2, 0.2, 0.2, 0.2],    # after 1
                          [0.25, 0.25, 0.2, 0.25, 0.05],  # after 2
                          [0.2, 0.2, 0.2, 0.2, 0.2],    # after 3
                          [0.6, 0.1, 0.1, 0.1, 0.1]])   # after 4

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(self.PROBS.log())
        self.config = type("Config", (), {"max_position_embeddings": 64})()

    def forward(self, input_ids, logits_to_keep=0):
        return type("Out", (), {"logits": self.weight[input_ids][:, -logits_to_keep:]})()


# Item 0: choice 0 = token 1 after context token 0 (ll log 0.5, 1 character), gold choice 1 =
# tokens 2, 3 (ll log 0.2 + log 0.25 = log 0.05, 6 characters): acc picks 0 (-0.69 > -3.00),
# acc_norm picks 1 (-3.00 / 6 = -0.50 > -0.69 / 1). Item 1: after token 4, gold 0 (log 0.6)
# beats 4 (log 0.1) on both counts.
HAND_ITEMS = [EncodedItem((0,), ((1,), (2, 3)), (1, 6), label=1),
              EncodedItem((3, 4), ((0,), (4,)), (3, 3), label=0)]


def flat(nested):
    return [x for row in nested for x in row]


def test_hand_computed_acc_and_acc_norm():
    lls = choice_logprobs(Bigram(), HAND_ITEMS, batch_size=3)
    expected = [[math.log(0.5), math.log(0.2) + math.log(0.25)], [math.log(0.6), math.log(0.1)]]
    assert flat(lls) == pytest.approx(flat(expected), abs=1e-6)
    result = evaluate_task(Bigram(), HAND_ITEMS)
    # acc: item 0 wrong, item 1 right; acc_norm: both right. The standard error of the mean
    # of [0, 1] is its sample std (1/sqrt 2) / sqrt(2) = 0.5; of [1, 1] it is 0.
    assert (result.n, result.acc, result.acc_norm) == (2, 0.5, 1.0)
    assert result.acc_stderr == pytest.approx(0.5) and result.acc_norm_stderr == 0.0
    assert result.line() == "acc=0.5000 acc_norm=1.0000 acc_stderr=0.5000 acc_norm_stderr=0.0000"


def test_a_tie_goes_to_the_first_choice():
    tie = [EncodedItem((1,), ((2,), (3,)), (1, 1), label=1)]  # P(2 | 1) == P(3 | 1)
    assert evaluate_task(Bigram(), tie).acc == 0.0
    assert evaluate_task(Bigram(), [EncodedItem((1,), ((2,), (3,)), (1, 1), label=0)]).acc == 1.0


def test_shares_add_up_and_a_wrapper_is_accepted():
    class Wrapped(torch.nn.Module):  # like DDP: the model in .module, no .config of its own
        def __init__(self):
            super().__init__()
            self.module = Bigram()

        def forward(self, input_ids, **kwargs):
            return self.module(input_ids, **kwargs)

    items = HAND_ITEMS * 3
    whole = count_correct(Bigram(), items)
    parts = sum(count_correct(Wrapped(), shard(items, rank, 4)) for rank in range(4))
    assert whole.tolist() == parts.tolist() == [6, 3, 6]
    assert DownstreamResult.from_counts(parts) == evaluate_task(Bigram(), items)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """A tiny trained model and its native export, with the committed tokenizer."""
    root = tmp_path_factory.mktemp("downstream")
    model = train_tiny(use_moe=False)
    pth = root / "pretrain_64.pth"
    save_pth(model.state_dict(), pth)
    model, _ = load_model(pth, **FLAGS)  # the half-precision round trip every script sees
    export_native(model, root / "hf", REPO_ROOT / "model")
    return root, model


def test_batched_scores_equal_one_sequence_at_a_time(tiny, tokenizer):
    _, model = tiny
    items = encode_task(tokenizer, load_task(TASK)[:4])
    batched = choice_logprobs(model, items, batch_size=7)
    for item, lls in zip(items, batched):
        for cont, ll in zip(item.continuation_ids, lls):
            ids = torch.tensor([item.context_ids + cont])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            by_hand = logprobs[len(item.context_ids) - 1:].gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert ll == pytest.approx(by_hand, abs=1e-4)


def test_encoding_splits_like_lm_eval(tokenizer):
    # The context's trailing whitespace moves into the continuation; the context is
    # tokenized on its own, the continuation is the rest of the whole's tokens.
    item = TaskItem("Return the value of x ", ("plus one.", "or None."), 0)
    enc = encode_item(tokenizer, item, bos=True)
    ctx = tokenizer.encode("Return the value of x", add_special_tokens=False)
    assert enc.context_ids == (tokenizer.bos_token_id, *ctx)
    whole = tokenizer.encode("Return the value of x  plus one.", add_special_tokens=False)
    assert enc.continuation_ids[0] == tuple(whole[len(ctx):])
    assert enc.choice_chars == (9, 8)
    assert encode_item(tokenizer, item, bos=False).context_ids == tuple(ctx)


def test_eval_cli_task_line_and_bad_task_files(tiny, tokenizer, tmp_path, capsys):
    root, model = tiny
    argv = ["--weight_path", str(root / "pretrain_64.pth"), *CLI_FLAGS, "--device", "cpu"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(TASK.read_text().splitlines(keepends=True)[:20]))
    eval_main([*argv, "--task", str(small)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = RESULT_LINE.fullmatch(last)
    assert match, last
    ours = evaluate_task(model, encode_task(tokenizer, load_task(small)))
    assert last == ours.line() and ours.n == 20
    good = '{"context": "a", "choices": ["b", "c"], "label": 0}\n'
    for text, expected in [(good + '{"context": "a"\n', ":2: not valid JSON"),
                           ('{"context": "a", "choices": ["b", "c"]}\n', ':1: no "label" field'),
                           ('{"context": "a", "choices": ["b", "c"], "label": 2}\n', ':1: "label" must be'),
                           ('{"context": "a", "choices": "bc", "label": 0}\n', ':1: "choices" must be')]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(DataError, match=re.escape(f"{bad}{expected}")):
            load_task(bad)
        with pytest.raises(SystemExit) as exit_info:
            eval_main([*argv, "--task", str(bad)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in err and f"{bad}{expected}" in err, err


# -----------------------------------------------------------------------------
# the task file and its builder

def test_build_eval_task_is_deterministic_and_held_out(tmp_path):
    corpus = ensure_demo_corpus()
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    for out, seed in ((a, 0), (b, 0), (c, 1)):
        build_main(["--data_path", str(corpus), "--every", "25", "--seed", str(seed), "--out", str(out)])
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    # The committed task is this very file (the command in the builder's docstring).
    assert a.read_bytes() == TASK.read_bytes()
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]
    train = "\n".join(text for i, text in enumerate(docs) if not is_held_out(i, 25))
    items = [json.loads(line) for line in a.read_text().splitlines()]
    assert 150 <= len(items) <= 600
    for item in items:
        assert is_held_out(item["doc"], 25)
        text = docs[item["doc"]]
        gold = item["choices"][item["label"]]
        assert text.startswith(item["context"] + " " + gold)
        assert item["context"][-40:] + " " + gold not in train  # never trained on
        for other in item["choices"]:
            # every distractor is real text from another held-out document, of about the gold's length
            assert abs(len(other) - len(gold)) <= 2
            assert other == gold or any(other in docs[i] for i in range(24, len(docs), 25) if i != item["doc"])
    assert task_misfit(TASK, corpus, 25) is None  # so the quick start uses the committed task here


def word_docs(n, seed=0):
    """n one-line documents of random words: no passage of one recurs in another."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(70)) for _ in range(n)]


@pytest.fixture
def built_task(tmp_path):
    """(corpus documents, the task build_eval_task cut from them, every 5th held out), and a writer
    of other corpora."""
    docs = word_docs(60)
    corpus = helpers_data.write_jsonl(tmp_path / "corpus.jsonl", docs)
    task = tmp_path / "task.jsonl"
    build_main(["--data_path", str(corpus), "--every", "5", "--out", str(task)])
    return docs, task, lambda texts: helpers_data.write_jsonl(tmp_path / "other.jsonl", texts)


def first_item(task):
    return json.loads(task.read_text().splitlines()[0])


# How a corpus at hand can differ from the one a task was cut from (the demo corpus built on
# another Python holds other documents, in another order), and what the check then says.
MISFITS = {
    "held_out_doc_edited": (lambda docs, item: [*docs[:item["doc"]], "Another " + docs[item["doc"]],
                                                *docs[item["doc"] + 1:]],
                            "held-out document {doc} of {corpus} does not start with the item's context and gold"),
    "one_doc_more_in_front": (lambda docs, item: ["a new first document", *docs],
                              "held-out document {doc} of {corpus} does not start with the item's context"),
    "passage_in_a_training_doc": (lambda docs, item: [*docs, item["context"][-40:] + " " + item["choices"][item["label"]]],
                                  "a training document of {corpus} holds the item's passage"),
}


def test_a_task_holds_only_in_the_corpus_it_was_cut_from(built_task):
    docs, task, write = built_task
    assert task_misfit(task, write(docs), 5) is None
    item = first_item(task)
    for case, (change, expected) in MISFITS.items():
        corpus = write(change(docs, item))
        why = task_misfit(task, corpus, 5)
        assert why is not None, case
        assert why.startswith(f"{task}:1: " + expected.format(doc=item["doc"], corpus=corpus)), (case, why)
    # another split of the same corpus: the item's document is a training one there
    corpus = write(docs)
    assert task_misfit(task, corpus, 6) == f"{task}:1: document {item['doc']} is not held out in {corpus} (every 6th of 60 documents)"
    # a distractor that is no held-out document's text: not a task of this split either
    lines = task.read_text().splitlines()
    wrong = 1 if item["label"] == 0 else 0
    item["choices"][wrong] = "zz" * 10
    task.write_text("\n".join([*lines[:-1], json.dumps(item)]) + "\n")
    assert task_misfit(task, write(docs), 5) == (f"{task}:{len(lines)}: choice {'zz' * 10!r} is text of no other "
                                                 f"held-out document of {write(docs)}")


def test_the_check_from_the_command_line_is_one_line_and_its_exit_code(built_task, capsys):
    docs, task, write = built_task
    build_main(["--data_path", str(write(docs)), "--every", "5", "--check", str(task)])
    assert "holds in" in capsys.readouterr().out
    moved = write(["a new first document", *docs])
    with pytest.raises(SystemExit) as info:
        build_main(["--data_path", str(moved), "--every", "5", "--check", str(task)])
    out = capsys.readouterr().out.strip()
    assert info.value.code == 1 and out.startswith(f"build_eval_task: {task}:1: ") and "\n" not in out, out
    with pytest.raises(SystemExit) as info:  # a task file that is not there: the same one line, not a traceback
        build_main(["--data_path", str(moved), "--every", "5", "--check", str(task) + ".missing"])
    out = capsys.readouterr().out.strip()
    assert info.value.code == 1 and out == f"build_eval_task: {task}.missing: not found: pass --check an existing .jsonl file"


# -----------------------------------------------------------------------------
# the same numbers from lm-evaluation-harness

@pytest.fixture
def keep_random_state():
    """simple_evaluate seeds Python's, numpy's and torch's generators; later tests get theirs back."""
    import random

    import numpy as np

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def test_lm_eval_agrees_with_our_scorer(tiny, tokenizer, monkeypatch, keep_random_state):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -r requirements-eval.txt)")
    from lm_eval.tasks import TaskManager

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    root, model = tiny
    limit = 40
    ours = {}
    for bos in (True, False):
        items = encode_task(tokenizer, load_task(TASK)[:limit], bos=bos)
        ours[bos] = evaluate_task(model, items)
        out = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={root / 'hf'},dtype=float32" + (",add_bos_token=True" if bos else ""),
            tasks=["minimind_heldout"], task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
            device="cpu", batch_size=16, limit=limit, log_samples=True)
        theirs = out["results"]["minimind_heldout"]
        samples = sorted(out["samples"]["minimind_heldout"], key=lambda sample: sample["doc_id"])
        their_lls = [[resp[0][0] for resp in sample["resps"]] for sample in samples]
        assert len(their_lls) == limit
        mine = flat(choice_logprobs(model, items))
        worst = max(abs(a - b) for a, b in zip(mine, flat(their_lls)))
        print(f"bos={bos}: max |log-likelihood difference| {worst:.2e}")
        assert mine == pytest.approx(flat(their_lls), abs=1e-4)
        for key in ("acc", "acc_norm"):
            assert 0 <= theirs[f"{key},none"] <= 1
            assert theirs[f"{key},none"] == pytest.approx(getattr(ours[bos], key), abs=1e-6)
            assert theirs[f"{key}_stderr,none"] == pytest.approx(getattr(ours[bos], f"{key}_stderr"), abs=1e-6)


def test_lm_eval_with_the_chat_template_agrees_with_our_chat_scorer(tiny, tokenizer, monkeypatch, keep_random_state):
    """`lm_eval --apply_chat_template` on the export asks each question as a user turn, in the
    template the export carries, and scores the choices after the generation prompt: our chat
    mode (encode_task(chat=True), eval_llm.py --chat, the fine-tuning stage's --eval_task)."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -r requirements-eval.txt)")
    from lm_eval.tasks import TaskManager

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    root, model = tiny
    limit = 40
    items = encode_task(tokenizer, load_task(SFT_TASK)[:limit], chat=True)
    assert tokenizer.decode(items[0].context_ids).startswith("<|im_start|>user\n")
    ours = evaluate_task(model, items)
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={root / 'hf'},dtype=float32", tasks=["minimind_sft_heldout"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False), device="cpu", batch_size=16,
        limit=limit, log_samples=True, apply_chat_template=True)
    theirs = out["results"]["minimind_sft_heldout"]
    samples = sorted(out["samples"]["minimind_sft_heldout"], key=lambda sample: sample["doc_id"])
    their_lls = [[resp[0][0] for resp in sample["resps"]] for sample in samples]
    assert len(their_lls) == limit
    assert flat(choice_logprobs(model, items)) == pytest.approx(flat(their_lls), abs=1e-4)
    for key in ("acc", "acc_norm"):
        assert theirs[f"{key},none"] == pytest.approx(getattr(ours, key), abs=1e-6)


# ---------------------------------------------------------------------------- in the training loop
@pytest.fixture(scope="module")
def trained_with_the_task(tmp_path_factory):
    """The same 4-step run with --eval_task in one process, as 2 DDP ranks and as 2 FSDP ranks,
    on the task's first 41 items (an odd count, so the DDP ranks' shares differ in size)."""
    root = tmp_path_factory.mktemp("eval_task")
    task = root / "task.jsonl"
    task.write_text("".join(TASK.read_text().splitlines(keepends=True)[:41]))
    flags = [*TINY, "--max_steps", "4", "--eval_interval", "2", "--global_batch_size", "8",
             "--eval_task", str(task)]
    specs = {"single": JobSpec([*flags, *out_args(root / "single")], root / "single", 1, "inprocess"),
             "ddp": JobSpec([*flags, *out_args(root / "ddp")], root / "ddp", 2, "forked"),
             "fsdp": JobSpec([*flags, *out_args(root / "fsdp"), "--parallel", "fsdp"], root / "fsdp", 2, "forked")}
    return task, {name: (specs[name].run_dir, result) for name, result in run_all(specs, timeout=300).items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp"])
def test_the_trainer_scores_the_task_beside_validation(trained_with_the_task, tokenizer, layout):
    """--eval_task puts acc and acc_norm in the log and the metrics at every validation; the
    score summed over the DDP ranks' shares (FSDP: every rank scores every item) is the one
    a single process gets from the same final weights."""
    task, runs = trained_with_the_task
    run_dir, result = runs[layout]
    assert_clean_exit(result.returncode, result.stdout, layout)
    rows = read_metrics(run_dir, kind="val")
    assert [row["step"] for row in rows] == [2, 4]
    assert re.search(r"step 4: .*task acc \d\.\d{4} ± \d\.\d{4} acc_norm \d\.\d{4} ± \d\.\d{4} \(41 items\)", result.stdout)
    assert all(0 <= row["task_acc"] <= 1 and row["task_acc_stderr"] > 0 for row in rows)
    if layout == "fsdp":
        return  # its final weights are DCP shards; its score's path is the replicated one, checked to run
    model = load_model_from_checkpoint(latest_checkpoint(run_dir))
    expected = evaluate_task(model, encode_task(tokenizer, load_task(task)))
    assert (rows[-1]["task_acc"], rows[-1]["task_acc_norm"]) == (expected.acc, expected.acc_norm)


def load_model_from_checkpoint(saved):
    model = MiniMindForCausalLM(MiniMindConfig.from_dict(saved["model_config"]))
    model.load_state_dict(saved["model"])
    return model.eval()


def test_the_paired_difference_of_two_models_by_hand():
    """scripts/compare_task.py: B - A item by item. Differences 0, 1, 0, -1: mean 0, sample
    variance (0 + 1 + 0 + 1) / 3, so the standard error is sqrt(2/3) / sqrt(4)."""
    from scripts.compare_task import paired

    mean, stderr = paired([True, False, True, True], [True, True, True, False])
    assert mean == 0 and stderr == pytest.approx(math.sqrt(2 / 3) / 2)
    assert paired([False] * 3, [True] * 3) == (1.0, 0.0)
