"""trainer/train_full_sft.py: the pre-training loop on conversations. It is launched the four
ways pre-training is, is the same run at any process count under --global_batch_size, resumes
a killed run bitwise, starts from the pre-trained weights by MiniMind's names, stops on a bad
line before step 1, and what it trains answers in stock transformers as it does here."""
import io
import json
import shutil

import pytest
import torch

from model.weights import load_model
from scripts.dev.launching import TRAIN_SFT
from scripts.prepare_data import prepare_sft
from tests.support.assertions import assert_bitwise_equal, assert_clean_exit, error_lines, max_abs_diff
from tests.support.fault_injection import fault_env
from tests.support.helpers_data import write_conversations
from tests.support.jobs import JobSpec, run_all, run_nodes, run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args
from tests.support.tiny import TINY

PREFIX = "full_sft_64"
STEPS, SAVE, KILL = 20, 10, 13
# lr 5e-4 for AdamW, as in test_scaling: float noise in near-zero gradients then stays below 1e-5.
BASE = [*TINY, "--from_weight", "none", "--learning_rate", "5e-4", "--max_steps", str(STEPS),
        "--save_interval", str(SAVE), "--global_batch_size", "8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_data")
    jsonl = write_conversations(root / "chat.jsonl", n=240)
    prepare_sft(jsonl, root / "chat.bin", num_proc=1)
    return jsonl, root / "chat.bin"


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """One SFT run on packed conversations (--doc_mask 1, the default) as one process (plain
    python), two (torchrun, and FSDP) and two single-process nodes; and two ranks killed at
    step 13, resumed by two under the legacy launcher and, from a copy, by one process.
    {name: (run_dir, Finished)}"""
    root, packed = tmp_path_factory.mktemp("sft"), data[1]

    def job(name, nproc, mode, *extra, env=None):
        flags = [*BASE, "--data_path", str(packed), *out_args(root / name), *extra]
        return JobSpec(flags, root / name, nproc, mode, env, script=TRAIN_SFT)

    first = {"single": job("single", 1, "python"), "ddp": job("ddp", 2, "torchrun"),
             "fsdp": job("fsdp", 2, "forked", "--parallel", "fsdp"),
             "killed": job("killed", 2, "forked", env=fault_env("kill", at=KILL, rank=1))}
    done = {name: (first[name].run_dir, result) for name, result in run_all(first, timeout=240).items()}
    shutil.copytree(root / "killed", root / "ws2to1", symlinks=True)
    resumed = {"killed/resumed": job("killed", 2, "legacy", "--from_resume", "1"),
               "ws2to1": job("ws2to1", 1, "forked", "--from_resume", "1")}
    done.update({name: (resumed[name].run_dir, result) for name, result in run_all(resumed, timeout=240).items()})
    nodes = [root / "nodes" / f"node{r}" for r in range(2)]
    flags = [*BASE, "--data_path", str(packed), *out_args(root / "nodes" / "shared")]
    done["nodes"] = (root / "nodes" / "shared", run_nodes(flags, nodes, script=TRAIN_SFT)[0])
    return done


def final_weights(runs, name):
    run_dir, result = runs[name]
    assert_clean_exit(result.returncode, result.stdout, name)
    saved = latest_checkpoint(run_dir, PREFIX)
    assert saved["global_step"] == STEPS
    return saved["model"]


def test_sft_is_the_same_run_at_any_process_count(runs):
    single = final_weights(runs, "single")
    for name in ("ddp", "nodes"):
        diff = max_abs_diff(final_weights(runs, name), single)
        print(f"{name} vs one process after {STEPS} steps: max |weight difference| {diff:.1e}")
        assert diff <= 1e-5


def test_fsdp_fine_tunes_as_ddp_does(runs):
    run_dir, result = runs["fsdp"]
    assert_clean_exit(result.returncode, result.stdout, "fsdp")
    assert "parallel=fsdp" in result.stdout
    fsdp = load_model(run_dir / "out" / f"{PREFIX}.pth")[0].float().state_dict()
    ddp = load_model(runs["ddp"][0] / "out" / f"{PREFIX}.pth")[0].float().state_dict()
    assert max_abs_diff(fsdp, ddp) <= 1e-3  # the inference weights, in half precision


def test_a_killed_two_process_run_resumes_in_one(runs):
    result = runs["ws2to1"][1]
    assert "samples per step (world size" not in result.stdout  # --global_batch_size: the same step size
    diff = max_abs_diff(final_weights(runs, "ws2to1"), final_weights(runs, "single"))
    print(f"killed at 2 processes, resumed at 1, against one process throughout: {diff:.1e}")
    assert diff <= 1e-5


def test_a_killed_sft_run_resumes_bitwise(runs):
    run_dir, killed = runs["killed"]
    assert killed.returncode not in (0, None) and f"SIGKILLs itself at step {KILL}" in killed.stdout
    resumed = runs["killed/resumed"][1]
    assert "resumed from" in resumed.stdout and f"at step {SAVE}/{STEPS}" in resumed.stdout
    assert_bitwise_equal(final_weights(runs, "killed/resumed"), final_weights(runs, "ddp"))


def test_the_log_says_what_fine_tuning_trains_on(runs):
    out = runs["single"][1].stdout
    assert "optimizer: " in out and "loaded weights" not in out  # --from_weight none: from scratch
    loss = [float(line.split(" loss ")[1].split()[0]) for line in out.splitlines() if " loss " in line]
    assert len(loss) == STEPS and loss[-1] < loss[0]


# ---------------------------------------------------------------------------- first weights, bad input
def test_from_weight_names_the_pretrained_weights_as_minimind_does(data, tmp_path):
    flags = [*TINY, "--max_steps", "2", *out_args(tmp_path)]
    missing = run_trainer([*flags, "--data_path", str(data[1])], tmp_path / "missing", script=TRAIN_SFT)
    assert missing.returncode == 2 and "Traceback" not in missing.stdout
    assert error_lines(missing.stdout) == [
        f"error: --from_weight pretrain: no {tmp_path}/out/pretrain_64.pth (a name means "
        f"{{save_dir}}/pretrain_{{hidden}}[_moe].pth, as MiniMind names it): train that stage first, pass the "
        f"weights file itself, or pass --from_weight none to start from scratch"]
    assert run_trainer(flags, tmp_path / "pretrain").returncode == 0  # pre-training writes out/pretrain_64.pth
    sft = run_trainer([*flags, "--data_path", str(data[1])], tmp_path / "sft", script=TRAIN_SFT)
    assert sft.returncode == 0, sft.stdout[-3000:]
    assert f"loaded weights from {tmp_path}/out/pretrain_64.pth" in sft.stdout
    assert (tmp_path / "out" / f"{PREFIX}.pth").is_file()


def test_a_bad_line_stops_fine_tuning_before_step_1(data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = data[0].read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:5]) + json.dumps({"conversations": [{"role": "bot", "content": "x"}]}) + "\n")
    result = run_trainer([*BASE, "--data_path", str(bad), *out_args(tmp_path)], tmp_path / "run", script=TRAIN_SFT)
    assert result.returncode == 2 and "Traceback" not in result.stdout and "step 1/" not in result.stdout
    assert error_lines(result.stdout) == [
        f"error: {bad}:6: turn 1: role 'bot'; a turn's role is one of system, user, assistant, tool"]


def test_conversations_cut_to_nothing_are_skipped_and_counted_once(data, tmp_path):
    """At --max_seq_len 40 the long replies of the JSONL (padded) path fit nowhere: the two
    ranks skip the same conversations, and the count is said once."""
    result = run_trainer([*BASE, "--max_seq_len", "40", "--max_steps", "2", "--data_path", str(data[0]),
                          *out_args(tmp_path)], tmp_path / "run", nproc=2, mode="forked", script=TRAIN_SFT)
    assert_clean_exit(result.returncode, result.stdout, "sft")
    said = [line for line in result.stdout.splitlines() if "conversations skipped" in line]
    assert len(said) == 1 and said[0].startswith("--data_path: ") and "--max_seq_len 40" in said[0], said


def test_augmentation_only_reads_from_jsonl(data, tmp_path):
    result = run_trainer([*BASE, "--data_path", str(data[1]), "--add_system_ratio", "0.2", *out_args(tmp_path)],
                         tmp_path / "run", script=TRAIN_SFT)
    assert result.returncode == 2
    assert "--add_system_ratio and --empty_think_ratio draw when a .jsonl line is read" in error_lines(result.stdout)[0]


# ---------------------------------------------------------------------------- use it as a chat model
def test_stock_transformers_answers_with_our_tokens(runs, tmp_path):
    """The export's tokenizer renders the chat prompt to our tokens, and greedy generate() in
    stock transformers gives the very tokens eval_llm.py --chat streams."""
    from argparse import Namespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dataset.chat import generation_prompt
    from dataset.lm_dataset import load_tokenizer
    from model.weights import load_model
    from scripts.convert_model import export_native
    from scripts.eval_llm import chat_reply
    from tests.support import REPO_ROOT

    run_dir = runs["single"][0]
    model = load_model(run_dir / "out" / f"{PREFIX}.pth")[0].float().eval()
    export_native(model, tmp_path / "hf", REPO_ROOT / "model")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_tokenizer(REPO_ROOT / "model")
    args = Namespace(max_new_tokens=24, do_sample=0, temperature=0.0, top_k=0, top_p=1.0)
    for messages in ([{"role": "user", "content": "What is 7?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12?"},
                      {"role": "assistant", "content": "It is the number 12."}, {"role": "user", "content": "More?"}]):
        prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert prompt == ours(generation_prompt(messages), add_special_tokens=False).input_ids
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                          eos_token_id=hf_tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):]
        mine = chat_reply(model, ours, messages, args, out=io.StringIO())
        assert generated.tolist() == mine


def test_eval_llm_chats_turn_after_turn(runs, monkeypatch, capsys):
    """In a terminal, eval_llm.py --chat keeps the conversation: the second question is asked
    after the first answer, as the chat template renders the two turns."""
    from argparse import Namespace

    from dataset.lm_dataset import load_tokenizer
    from scripts import eval_llm
    from tests.support import REPO_ROOT

    model = load_model(runs["single"][0] / "out" / f"{PREFIX}.pth")[0].float().eval()
    tokenizer = load_tokenizer(REPO_ROOT / "model")
    asked = []
    real = eval_llm.chat_reply
    monkeypatch.setattr(eval_llm, "chat_reply", lambda m, t, turns, a, out=None: asked.append(list(turns)) or
                        real(m, t, turns, a, out))
    typed = iter(["What is 3?", "More?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(typed))
    args = Namespace(chat=True, max_new_tokens=8, do_sample=0, temperature=0.0, top_k=0, top_p=1.0)
    eval_llm.interactive(model, tokenizer, args)
    assert [t["content"] for t in asked[0]] == ["What is 3?"]
    assert [t["role"] for t in asked[1]] == ["user", "assistant", "user"] and asked[1][2]["content"] == "More?"
    assert asked[1][1]["content"] == tokenizer.decode(real(model, tokenizer, asked[0], args, io.StringIO()),
                                                      skip_special_tokens=True)
