"""scripts/bench/bench_quality.py's variants and its report, on hand-made validation curves
(the benchmark's training runs are not tests)."""
import hashlib
import re
import shlex

import pytest

from scripts.bench.bench_quality import (
    VARIANTS, at_time, first_reach, parse_args, report, report_seeds, run_seeds, seed_run, variant_table,
)
from scripts.bench.held_out_ood import mixed_verdicts, ood_file, ood_line
from tests.support import REPO_ROOT
from trainer.config import parse_config
from trainer.evaluate import DownstreamResult


def test_a_variant_flag_is_b_defaults_plus_its_flags_in_order():
    args = parse_args(["--variants", "a_minimind,c_adamw", "--variant", "muon_x2=--muon_lr 0.04 --warmup_steps 30",
                       "--variant", "plain=--seed 3"])
    table = variant_table(args)
    assert list(table) == ["a_minimind", "c_adamw", "muon_x2", "plain"]
    assert table["muon_x2"] == ("bin", ["--muon_lr", "0.04", "--warmup_steps", "30"])
    assert table["a_minimind"][0] == "jsonl"


def test_a_minimind_is_the_readmes_recipe_line_on_padded_jsonl():
    """(a) claims to be MiniMind's recipe; the README's "Flags" section says what that is. A flag
    left out (as --adam_betas 0.9,0.999 once was) would benchmark another recipe under its name."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"MiniMind's exact recipe is one set of flags away:\s*```bash\n(.*?)```", readme, re.S)
    assert block, "the README's recipe block moved: update this test"
    recipe = shlex.split(block.group(1).replace("\\\n", " "), comments=True)
    kind, flags = VARIANTS["a_minimind"]
    assert kind == "jsonl"  # MiniMind's padded path
    assert flags == recipe
    parsed = parse_config(["--data_path", "x.jsonl", *flags])[0].optim  # and the trainer reads it as MiniMind's AdamW
    assert (parsed.optimizer, parsed.param_groups, parsed.adam_betas, parsed.lr_schedule) == \
        ("adamw", "single", (0.9, 0.999), "cosine")


@pytest.mark.parametrize("bad", ["no_equals", "=--seed 1", "b_defaults=--seed 1", "a/b=--seed 1"])
def test_a_malformed_variant_is_one_line_naming_it(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--variant", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert repr(bad) in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_missing_corpus_is_one_line_and_the_missing_demo_corpus_is_built(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--corpus", str(tmp_path / "nowhere.jsonl")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "--corpus" in err and "nowhere.jsonl: not found" in err
    assert len(err.splitlines()) == 1, err
    from scripts.bench import bench_quality
    from tests.support import helpers_data

    demo = tmp_path / "demo.jsonl"  # the default corpus, not built yet: built as the trainer builds it
    docs = [f"document {d}: " + " ".join(f"w{(d * 7 + k) % 50}" for k in range(80)) for d in range(50)]
    built = []
    monkeypatch.setattr(bench_quality, "DEMO_CORPUS", demo)
    monkeypatch.setattr(bench_quality, "ensure_demo_corpus",
                        lambda path: built.append(path) or helpers_data.write_jsonl(path, docs))
    data = bench_quality.prepare_data(demo, tmp_path / "data")
    assert built == [demo] and (data / "val.bin").stat().st_size > 0


CURVE = [{"step": 10, "train_s": 5.0, "val_loss": 6.0, "val_bpb": 2.0},
         {"step": 20, "train_s": 10.0, "val_loss": 5.0, "val_bpb": 1.8}]


def test_time_to_a_loss_is_interpolated_between_validations():
    assert first_reach(CURVE, 5.5, "train_s") == pytest.approx(7.5)
    assert first_reach(CURVE, 5.5, "step") == pytest.approx(15)
    assert first_reach(CURVE, 6.5, "step") == 10  # reached by the first validation
    assert first_reach(CURVE, 4.0, "step") is None


def test_bits_per_byte_at_a_time_past_the_run_is_its_last_value():
    assert at_time(CURVE, 7.5, "val_bpb") == pytest.approx(1.9)
    assert at_time(CURVE, 100.0, "val_bpb") == 1.8


def test_the_table_has_each_variants_final_task_accuracy():
    args = parse_args(["--variants", "a_minimind,b_defaults", "--steps", "20"])
    curves = {"a_minimind": CURVE, "b_defaults": CURVE}
    accuracy = {"a_minimind": DownstreamResult.from_counts([400, 174, 170]), "b_defaults": None}
    lines = report(curves, args, accuracy)
    header, rule, row_a, row_b = lines[2:6]
    assert header.endswith("| task acc (chance 0.25) |") and rule.count("|") == header.count("|")
    # 174 / 400 = 0.435, sample-std standard error sqrt(0.435 * 0.565 / 399) = 0.0248
    assert row_a.startswith("| a_minimind |") and row_a.endswith("| 0.435 ± 0.025 |")
    assert row_b.startswith("| b_defaults |") and row_b.endswith("| - |")  # no final weights to score
    assert row_a.count("|") == header.count("|")


def test_seeds_are_the_trainers_default_and_the_next_ones_and_win_over_a_variants():
    one, three = parse_args([]), parse_args(["--seeds", "3"])
    assert run_seeds(one) == [42] and run_seeds(three) == [42, 43, 44]
    assert seed_run("plain", ["--seed", "3"], 42, one) == ("plain", ["--seed", "3"])  # --seeds 1: as ever
    assert seed_run("plain", ["--seed", "3"], 43, three) == ("plain_seed43", ["--seed", "3", "--seed", "43"])
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "0"])


def test_the_seeds_table_has_each_figures_mean_and_range_against_a_of_the_same_seed():
    """Seed 42: (a) ends at loss 5.0 after 10 s (CURVE); b reaches 5.0 half-way between its
    validations at 4 s and 12 s (8 s), its bits/byte at 10 s is 1.9 - 0.4 * 6 / 8 = 1.6, and it
    ends at 1.5. Seed 43: (a) ends at 5.2 after 12 s, which b never reaches; b's bits/byte is
    1.85 at 12 s and at the end. Means: 1.675 final, 1.725 at (a)'s time; (a) reaches its own
    final loss at its end, 10 and 12 s, step 20; b's seed 42 at step 15."""
    args = parse_args(["--variants", "a_minimind,b_defaults", "--seeds", "2"])
    a_43 = [{"step": 10, "train_s": 6.0, "val_loss": 6.0, "val_bpb": 2.0},
            {"step": 20, "train_s": 12.0, "val_loss": 5.2, "val_bpb": 1.9}]
    b_42 = [{"step": 10, "train_s": 4.0, "val_loss": 5.5, "val_bpb": 1.9},
            {"step": 20, "train_s": 12.0, "val_loss": 4.5, "val_bpb": 1.5}]
    b_43 = [{"step": 10, "train_s": 6.0, "val_loss": 5.6, "val_bpb": 1.95},
            {"step": 20, "train_s": 12.0, "val_loss": 5.4, "val_bpb": 1.85}]
    runs = {"a_minimind": {42: CURVE, 43: a_43}, "b_defaults": {42: b_42, 43: b_43}}
    accuracy = {"a_minimind": {42: None, 43: None},
                "b_defaults": {42: DownstreamResult.from_counts([400, 174, 170]),    # 0.435
                               43: DownstreamResult.from_counts([400, 150, 150])}}  # 0.375
    ood = {"a_minimind": {42: {"bpb": 2.2}, 43: None},  # seed 43 of (a) left no final weights
           "b_defaults": {42: {"bpb": 2.0}, 43: {"bpb": 2.3}}}
    lines = report_seeds(runs, args, accuracy, ood)
    header, rule, row_a, row_b = lines[2:6]
    assert header == ("| variant | time to (a)'s final loss, s | steps to it | final bits/byte | OOD bits/byte, final "
                      "| bits/byte at (a)'s time | task acc (chance 0.25) |") and rule.count("|") == header.count("|")
    assert row_a == ("| a_minimind | 11.0 (10.0-12.0) | 20.0 (20.0-20.0) | 1.8500 (1.8000-1.9000) | 2.2000 (2.2000-2.2000), "
                     "1 of 2 | 1.8500 (1.8000-1.9000) | - |")
    assert row_b == ("| b_defaults | 8.0 (8.0-8.0), 1 of 2 | 15.0 (15.0-15.0), 1 of 2 | 1.6750 (1.5000-1.8500) "
                     "| 2.1500 (2.0000-2.3000) | 1.7250 (1.6000-1.8500) | 0.405 (0.375-0.435) |")
    # The rule on the means: b is 1.675 against 1.85 in distribution and 2.15 against 2.2 out of it.
    assert lines[7] == "bench_quality: no variant beats a_minimind or b_defaults on one held-out set and loses on the other"


def test_the_committed_task_is_scored_only_where_it_holds_in_the_corpus(tmp_path, monkeypatch, capsys):
    """On the demo corpus bench_quality scores the committed task, unless its items are not the
    held-out documents of the corpus at hand (a demo corpus built on another Python): then a task
    built from that corpus's own held-out split, with one line saying why."""
    from scripts.bench import bench_quality
    from scripts.build_eval_task import main as build_main
    from tests.support import helpers_data

    words = [f"w{i}x{i * 7 % 13}" for i in range(300)]
    docs = [" ".join(words[(d * 31 + k * k) % 300] for k in range(60)) for d in range(100)]
    corpus = helpers_data.write_jsonl(tmp_path / "demo.jsonl", docs)
    committed = tmp_path / "committed.jsonl"
    build_main(["--data_path", str(corpus), "--every", "25", "--out", str(committed)])
    monkeypatch.setattr(bench_quality, "DEMO_CORPUS", corpus)
    monkeypatch.setattr(bench_quality, "DEFAULT_TASK", committed)
    args = parse_args(["--corpus", str(corpus)])
    data = tmp_path / "data"
    data.mkdir()
    capsys.readouterr()
    assert bench_quality.task_file(args, data) == committed
    assert "instead" not in capsys.readouterr().out
    helpers_data.write_jsonl(corpus, ["one more document, first", *docs])  # this machine's build differs
    task = bench_quality.task_file(args, data)
    assert task == data / "task.jsonl" and task.is_file()
    out = capsys.readouterr().out
    assert f"bench_quality: {committed}:1: held-out document" in out and "built from this one's own held-out documents" in out


def test_the_table_has_each_variants_final_ood_bits_per_byte_and_flags_a_mixed_verdict():
    """b ends at 1.8 in distribution like (a) but 2.1 out of it against (a)'s 2.0 (+5.0%): no
    flag, since it does not beat (a) anywhere; c ends lower in distribution (1.7) and higher out
    of it (2.05): flagged against (a)."""
    args = parse_args(["--variants", "a_minimind,b_defaults", "--variant", "c=--seed 3", "--steps", "20"])
    lower = [dict(CURVE[0]), dict(CURVE[1], val_bpb=1.7)]
    ood = {"a_minimind": {"bpb": 2.0}, "b_defaults": {"bpb": 2.1}, "c": {"bpb": 2.05}}
    lines = report({"a_minimind": CURVE, "b_defaults": CURVE, "c": lower}, args, None, ood)
    header, rule, row_a, row_b, row_c = lines[2:7]
    assert "| last bits/byte | OOD bits/byte, final | vs (a) |" in header and rule.count("|") == header.count("|")
    assert "| 1.8000 | 2.0000 | +0.0% |" in row_a and "| 1.8000 | 2.1000 | +5.0% |" in row_b
    assert "| 1.7000 | 2.0500 | +2.5% |" in row_c and row_c.count("|") == header.count("|")
    # c beats b in distribution and on the OOD set: only (a) is a reference it breaks the rule against.
    assert lines[7:] == ["", "bench_quality: RULE BROKEN: c beats a_minimind in distribution and loses out of "
                         "distribution (final bits/byte 1.7000, OOD 2.0500; a_minimind's 1.8000, 2.0000): a default "
                         "must not win on one held-out set and lose on the other"]
    lines = report({"a_minimind": CURVE, "b_defaults": CURVE}, args, None, {"a_minimind": None, "b_defaults": None})
    assert "| 1.8000 | - | - |" in lines[4] and lines[6:] == [""]  # no final weights: nothing to check


def test_the_rule_is_checked_against_the_defaults_too_and_ties_break_nothing():
    finals = {"a_minimind": (2.0, 2.5), "b_defaults": (1.7, 2.2), "opt": (1.69, 2.21), "same": (1.7, 2.2),
              "both": (1.6, 2.1), "partial": (1.5, None)}
    lines = mixed_verdicts(finals)
    assert len(lines) == 1 and lines[0].startswith("bench_quality: RULE BROKEN: opt beats b_defaults in "
                                                   "distribution and loses out of distribution"), lines
    assert mixed_verdicts({"a_minimind": (2.0, 2.5), "b_defaults": (2.1, 2.4)})[0].startswith(
        "bench_quality: RULE BROKEN: b_defaults beats a_minimind out of distribution and loses in distribution")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny model's final weights where the bench looks for a run's (as the trainer writes them),
    and a small OOD file: real README text, a non-ASCII line and a document past --max_seq_len."""
    from dataset.ood_corpus import chunk, description, pinned_packages
    from model.weights import write_weights
    from tests.support import helpers_data
    from tests.support.tiny import train_tiny

    root = tmp_path_factory.mktemp("bench_ood")
    args = parse_args(["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "48"])
    model = train_tiny(use_moe=False)
    write_weights(model.state_dict(), model.config, root / "b_defaults" / "bench_64.pth")
    version = dict(pinned_packages())["tqdm"]
    docs = [*chunk(description("tqdm", version))[:6], "小型语言模型也可以很有用。" * 3, "word " * 200]
    return root, args, helpers_data.write_jsonl(root / "ood.jsonl", docs), len(docs)


def test_the_ood_bits_per_byte_of_final_weights_is_eval_llms(tiny_run, tiny_tokenizer_dir, capsys):
    from scripts.bench.bench_quality import final_scores
    from scripts.eval_llm import main as eval_main
    from trainer.evaluate import TaskItem, encode_task
    from transformers import AutoTokenizer

    root, args, ood, n_docs = tiny_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    items = encode_task(tokenizer, [TaskItem("the quick brown", ("fox", "dog"), 0)])
    acc, scores = final_scores(root / "b_defaults", args, items, tokenizer, ood)
    assert acc.n == 1 and scores["docs"] == n_docs
    capsys.readouterr()
    eval_main(["--weight_path", str(root / "b_defaults" / "bench_64.pth"), "--tokenizer_path", str(tiny_tokenizer_dir),
               "--ppl_data", str(ood), "--max_seq_len", "48", "--device", "cpu"])
    printed = dict(field.split("=", 1) for field in capsys.readouterr().out.split()[1:])
    assert int(printed["docs"]) == scores["docs"] and int(printed["tokens"]) == scores["tokens"]
    assert float(printed["bits_per_byte"]) == pytest.approx(scores["bpb"], abs=1e-6)
    assert float(printed["loss"]) == pytest.approx(scores["loss"], abs=1e-6)
    assert 0 < scores["bpb"] < scores["loss"]
    assert final_scores(root / "a_minimind", args, items, tokenizer, ood) == (None, None)  # stopped before saving


def test_the_ood_set_is_built_once_without_the_corpus_text_unless_one_is_given(tmp_path, tiny_run):
    from dataset.demo_corpus import DEMO_CORPUS
    from dataset.ood_corpus import DOC_COUNT

    args = parse_args(["--corpus", str(DEMO_CORPUS)])
    built = ood_file(args, tmp_path)
    assert built == tmp_path / "ood.jsonl" and len(built.read_text().splitlines()) == DOC_COUNT
    stamp = built.stat().st_mtime_ns
    assert ood_file(args, tmp_path) == built and built.stat().st_mtime_ns == stamp
    assert ood_line(built).endswith(hashlib.sha256(built.read_bytes()).hexdigest())
    given = tiny_run[2]
    assert ood_file(parse_args(["--ood_data", str(given)]), tmp_path / "elsewhere") == given
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(SystemExit):
        parse_args(["--ood_data", str(tmp_path / "nowhere.jsonl")])


def test_the_ood_curves_table_reads_each_seed_against_as_final_ood_loss_and_time():
    """(a)'s seed 42 ends at OOD loss 5.5 after 20 s, seed 43 at 5.0 after 25 s. b's seed 42 falls
    from 6.0 at 5 s to 5.0 at 10 s: 5.5 halfway, at 7.5 s and step 15, 20 / 7.5 = 2.67x sooner;
    its seed 43 gets to 5.0 at its second point, 10 s and step 20, 25 / 10 = 2.5x."""
    from scripts.bench.held_out_ood import ood_reach_lines

    a = {42: [dict(CURVE[0], val_loss=5.8), dict(CURVE[1], train_s=20.0, val_loss=5.5, val_bpb=2.2)],
         43: [dict(CURVE[0], val_loss=5.2), dict(CURVE[1], train_s=25.0, val_loss=5.0, val_bpb=2.1)]}
    b = {42: CURVE, 43: [CURVE[0], dict(CURVE[1], val_bpb=1.6)]}
    header, rule, row_a, row_b = ood_reach_lines({"a_minimind": a, "b": b}, {42: 20.0, 43: 25.0})
    assert header.startswith("| variant | time to (a)'s final OOD loss, s |") and rule.count("|") == header.count("|")
    assert row_a == "| a_minimind | 22.5 (20.0-25.0) | 1.0 (1.0-1.0) | 20.0 (20.0-20.0) | 2.1500 (2.1000-2.2000) |"
    assert row_b == "| b | 8.8 (7.5-10.0) | 2.6 (2.5-2.7) | 17.5 (15.0-20.0) | 1.7000 (1.6000-1.8000) |"
    never = ood_reach_lines({"a_minimind": a, "b": {42: [dict(CURVE[0], val_loss=9.0)], 43: CURVE}},
                            {42: 20.0, 43: 25.0})[3]
    assert never.startswith("| b | 10.0 (10.0-10.0), 1 of 2 | 2.5 (2.5-2.5), 1 of 2 |")


def test_the_ood_curve_scores_each_kept_checkpoint_at_its_validations_time(tmp_path, tiny_run, tiny_tokenizer_dir):
    """Two resume checkpoints, steps 5 and 10 (other weights): each scored as final weights are,
    at its step's training seconds; the older removed once scored, the curve kept and read back."""
    import json

    import torch
    from transformers import AutoTokenizer

    from model.weights import load_model
    from scripts.bench.held_out_ood import ood_curve, ood_score

    root, args, ood, _ = tiny_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model, _ = load_model(root / "b_defaults" / "bench_64.pth")
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    expected = []
    for step in (5, 10):
        with torch.no_grad():
            model.model.norm.weight.mul_(0.5)
        path = ckpt / f"bench_64_resume_step{step:07d}.pth"
        torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, path)
        path.with_name(path.name + ".json").write_text(json.dumps({"tokens_seen": step * 100}))
        expected.append(ood_score(model, tokenizer, ood, 48))
    val = [{"step": 5, "train_s": 1.5}, {"step": 10, "train_s": 3.25}]
    curve = ood_curve(tmp_path / "run", "bench_64", val, tokenizer, ood, 48)
    assert [(row["step"], row["train_s"]) for row in curve] == [(5, 1.5), (10, 3.25)]
    for row, scores in zip(curve, expected):
        assert (row["val_loss"], row["val_bpb"]) == pytest.approx((scores["loss"], scores["bpb"]), abs=1e-6)
    assert expected[0]["loss"] != pytest.approx(expected[1]["loss"], abs=1e-3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["bench_64_resume_step0000010.pth",
                                                      "bench_64_resume_step0000010.pth.json"]
    assert ood_curve(tmp_path / "run", "bench_64", [], tokenizer, ood, 48) == curve  # read back, nothing rescored


@pytest.mark.parametrize("every", ["-5", "7"])
def test_ood_every_must_be_a_multiple_of_eval_every(every, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ood_every", every, "--eval_every", "5"])
    err = capsys.readouterr().err.strip()
    assert f"--ood_every {every}" in err and len(err.splitlines()) == 1
    assert parse_args(["--ood_every", "10", "--eval_every", "5"]).ood_every == 10
