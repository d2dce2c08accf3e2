"""Untrusted input: a crafted .pth never runs code, .safetensors works wherever a .pth
does, and every bad flag is one line with rc 2 before the first training step.

Subprocesses only where the process itself is the point: the payload file through each
of the three entry points, one torchrun run showing that every rank stops on a bad flag
with one line, and the shared --checkpoint_dir check, which needs two ranks. The flag
checks themselves run in-process through train_pretrain.main.
"""
import json
import os
import tempfile

import pytest
import torch

from model.model_minimind import MiniMindConfig
from common.errors import UserError, WeightsError
from model.weights import load_model, read_checkpoint, write_weights
from scripts.convert_model import save_pth
from scripts.eval_llm import main as eval_main
from tests.support.assertions import assert_clean_exit, error_lines, worker_tracebacks
from tests.support import REPO_ROOT
from tests.support.jobs import JobSpec, run_all
from tests.support.run_outputs import latest_link_name, out_args
from tests.support.tiny import FLAGS, TINY, train_tiny
from trainer.device import resolve_device
from trainer.checkpoint import verify_checkpoint
from trainer.train_pretrain import main as train_main
from trainer.trainer_utils import init_model, lm_checkpoint

SCRIPTS = REPO_ROOT / "scripts"


class Payload:
    """Unpickling this runs `touch marker`: what a malicious weights file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_payload(path, marker):
    torch.save({"model.embed_tokens.weight": torch.zeros(4, 4), "x": Payload(marker)}, path)


def test_the_payload_is_live_when_fully_unpickled(tmp_path):
    # The premise of the tests below: a full unpickle of this file does run its code.
    write_payload(tmp_path / "evil.pth", tmp_path / "marker")
    torch.load(tmp_path / "evil.pth", weights_only=False)
    assert (tmp_path / "marker").exists()


def test_read_checkpoint_refuses_the_payload_in_one_line(tmp_path):
    write_payload(tmp_path / "evil.pth", tmp_path / "marker")
    with pytest.raises(WeightsError) as info:
        read_checkpoint(tmp_path / "evil.pth")
    assert not (tmp_path / "marker").exists()
    message = str(info.value)
    assert "\n" not in message and "refused" in message and "posix.system" in message, message


def test_a_file_torch_save_never_wrote_is_named_so_not_called_unsafe(tmp_path):
    """A text file passed as weights (a .jsonl, say) is no pickle at all: the line says it is not a
    weights file, where a pickle with a payload (above) is refused as unsafe."""
    text = tmp_path / "val.jsonl"
    text.write_text('{"text": "hello"}\n')
    with pytest.raises(WeightsError) as info:
        read_checkpoint(text)
    assert "not a weights file" in str(info.value) and "unpickling" not in str(info.value)


@pytest.mark.parametrize("content", [
    {1: torch.zeros(2)},  # a name that is not a string
    {"model": [torch.zeros(2)], "model_config": {}},  # a resume checkpoint whose model is no state_dict
    {"model": {"w": 3}, "model_config": {}},  # ... or holds a number
])
def test_a_pth_of_plain_containers_but_not_weights_is_one_line(tmp_path, content):
    torch.save(content, tmp_path / "odd.pth")
    with pytest.raises(WeightsError, match="neither a weights file .* nor a resume checkpoint"):
        read_checkpoint(tmp_path / "odd.pth")


def test_wrapper_prefixes_go_in_either_order(tmp_path):
    torch.save({"_orig_mod.module.a": torch.zeros(1), "module._orig_mod.b": torch.ones(1)}, tmp_path / "w.pth")
    assert sorted(read_checkpoint(tmp_path / "w.pth")[0]) == ["a", "b"]


# -----------------------------------------------------------------------------
# the three entry points, as processes

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The payload through each entry point, and a bad flag under 2-process torchrun. Each
    entry point is a process of its own, forked from the preloaded trainer (tests/support/forked_ranks.py),
    as is the shared-directory check's pair of ranks; torchrun's own job is a real torchrun."""
    root = tmp_path_factory.mktemp("untrusted")
    evil = root / "evil.pth"
    jobs = {
        "eval_llm": JobSpec(["--weight_path", str(evil), "--prompt", "x", "--device", "cpu"], root / "eval_llm",
                            mode="forked", script=SCRIPTS / "eval_llm.py"),
        "train_pretrain": JobSpec([*TINY, *out_args(root / "train_pretrain"), "--max_steps", "2",
                                   "--from_weight", str(evil)], root / "train_pretrain", mode="forked"),
        "convert_model": JobSpec(["--weight_path", str(evil), "--out_dir", str(root / "hf")], root / "convert_model",
                                 mode="forked", script=SCRIPTS / "convert_model.py"),
        "torchrun_bad_flag": JobSpec([*TINY, *out_args(root / "torchrun_bad_flag"), "--learning_rate", "nan"],
                                     root / "torchrun_bad_flag", nproc=2, mode="torchrun",
                                     launcher_args=("--standalone",)),
        "shared_dir": JobSpec([str(root / "shared_dir")], root / "shared_dir", nproc=2, mode="forked",
                              script=REPO_ROOT / "tests" / "support" / "shared_dir_worker.py"),
    }
    (root / "shared_dir").mkdir()
    (root / "shared_dir" / "a_file").write_text("not a folder")
    # One payload file for all three entry points: any of them that unpickles it leaves the marker.
    write_payload(evil, root / "marker")
    results = run_all(jobs, timeout=240)
    return root, results


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["eval_llm", "train_pretrain", "convert_model"])
def test_payload_is_refused_by_every_entry_point(launched, entry_point):
    root, results = launched
    result = results[entry_point]
    out = result.stdout
    assert not (root / "marker").exists(), "the payload ran"
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "error:" in line]
    assert len(lines) == 1, out[-3000:]
    assert "refused" in lines[0] and "evil.pth" in lines[0], lines[0]


@pytest.mark.slow
def test_bad_flag_under_torchrun_stops_every_rank_with_one_line(launched):
    root, results = launched
    result = results["torchrun_bad_flag"]
    out = result.stdout
    assert result.returncode == 1 and "exitcode  : 2" in out, out[-3000:]  # torchrun's rc; the workers exit 2
    assert not worker_tracebacks(out), worker_tracebacks(out)[0]
    assert error_lines(out) == ["error: --learning_rate must be a finite number above 0 (the peak learning rate, "
                                "e.g. 5e-4), got nan"], out[-3000:]
    assert not (root / "torchrun_bad_flag" / "out").exists()  # stopped before even creating --save_dir


@pytest.mark.slow
def test_fsdp_checkpoint_dir_must_be_shared_by_all_ranks(launched):
    root, results = launched
    assert_clean_exit(results["shared_dir"].returncode, results["shared_dir"].stdout, "shared-dir check")
    decisions = [json.loads((root / "shared_dir" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert decisions[0] == decisions[1], decisions  # every rank takes the same decision
    assert decisions[0]["fsdp_shared"] is None
    assert "--checkpoint_dir" in decisions[0]["fsdp_not_shared"]
    assert "not shared by all nodes" in decisions[0]["fsdp_not_shared"]
    assert "is a file" in decisions[0]["ddp_rank0_dir_is_a_file"]
    assert os.listdir(root / "shared_dir" / "ckpt") == []  # the marker and write probes are gone


# -----------------------------------------------------------------------------
# .safetensors wherever a .pth goes

@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    state = train_tiny(use_moe=False).state_dict()
    pth, st = root / "w.pth", root / "w.safetensors"
    save_pth(state, pth)
    save_pth(state, st)
    return root, pth, st


def logits_of(model):
    ids = torch.randint(3, 6400, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def test_safetensors_gives_the_same_logits_as_the_pth(weights, capsys):
    root, pth, st = weights
    assert logits_of(load_model(pth, **FLAGS)[0]).equal(logits_of(load_model(st, **FLAGS)[0]))
    # --from_weight
    config = MiniMindConfig(**FLAGS)
    assert logits_of(init_model(config, str(pth)).eval()).equal(logits_of(init_model(config, str(st)).eval()))
    # eval_llm.py --weight_path: the same perplexity line
    data = root / "val.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello world", "the quick brown fox"]))
    lines = []
    capsys.readouterr()
    for path in (pth, st):
        eval_main(["--weight_path", str(path), *[x for k, v in FLAGS.items() for x in (f"--{k}", str(v))],
                   "--ppl_data", str(data), "--device", "cpu"])
        lines.append(capsys.readouterr().out.splitlines()[-1].split(" ", 1)[1])  # drop the file name
    assert lines[0] == lines[1] and "loss=" in lines[0]


def test_an_hf_model_safetensors_without_lm_head_loads(weights, tmp_path):
    from safetensors.torch import load_file, save_file

    _, pth, st = weights
    tensors = load_file(st)
    del tensors["lm_head.weight"]  # how a tied export stores it
    save_file(tensors, tmp_path / "model.safetensors")
    assert logits_of(load_model(pth, **FLAGS)[0]).equal(logits_of(load_model(tmp_path / "model.safetensors", **FLAGS)[0]))


def test_a_corrupt_safetensors_is_one_line(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightsError, match="not a readable .safetensors file"):
        read_checkpoint(tmp_path / "bad.safetensors")


QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 6400,
         "tie_word_embeddings": True}


@pytest.mark.parametrize("config,says", [
    ({"model_type": "minimind", "hidden_size": "64"}, "TypeError"),
    ({**QWEN3, "eos_token_id": []}, "IndexError"),
    ({**QWEN3, "head_dim": 15}, "not a model config"),  # transformers' own check says it
    ({**QWEN3, "num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_an_export_whose_config_makes_no_model_is_one_line(tmp_path, config, says):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as info:
        load_model(hf_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "config.json: not a model config" in message and says in message, message


def test_an_export_index_naming_no_files_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": 3}}))
    with pytest.raises(WeightsError, match="no weight_map of file names in the folder"):
        load_model(hf_dir=tmp_path)


# -----------------------------------------------------------------------------
# what the trainer writes still loads

def test_every_pth_the_trainer_writes_still_loads(tmp_path):
    """The trainer's own save functions: inference weights and a resume checkpoint after a
    real AdamW step (optimizer state, RNG states, scaler), read back by the strict loader."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    model = init_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 6400, (2, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    write_weights(model.state_dict(), model.config, str(tmp_path / "out" / "pretrain_64.pth"))
    state = {"scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(), "global_step": 1, "epoch": 0,
             "step_in_epoch": 1, "samples_per_step": 2, "world_size": 1, "tokens_seen": 32, "wandb_run_id": None}
    step_file = lm_checkpoint(str(tmp_path / "ckpt"), "pretrain_64", model, optimizer, state=state)
    verify_checkpoint(step_file)  # the trainer's own resume path

    model.eval()
    half = load_model(tmp_path / "out" / "pretrain_64.pth", hidden_size=64, num_hidden_layers=2)[0]
    assert (logits_of(half) - logits_of(model)).abs().max() < 0.05  # fp16 weights
    for path in (step_file, tmp_path / "ckpt" / latest_link_name()):
        assert logits_of(load_model(path)[0]).equal(logits_of(model))  # fp32, config stored


# -----------------------------------------------------------------------------
# bad flags: one line, rc 2, before any step

BAD_FLAGS = {
    # the table
    "max_seq_len_1": (["--max_seq_len", "1"], "--max_seq_len must be at least 2, got 1"),
    "num_workers_negative": (["--num_workers", "-1"], "--num_workers must be at least 0, got -1"),
    "learning_rate_negative": (["--learning_rate", "-1"], "--learning_rate must be a finite number above 0"),
    "learning_rate_nan": (["--learning_rate", "nan"], "--learning_rate must be a finite number above 0"),
    "checkpoint_dir_is_a_file": (["--checkpoint_dir", "{file}"], "--checkpoint_dir {file}: is a file, not a folder"),
    "save_dir_unwritable": (["--save_dir", "/proc/nope"], "--save_dir /proc/nope: cannot create or write there"),
    # the rest of the class
    "save_dir_under_a_file": (["--save_dir", "{file}/out"], "--save_dir {file}/out: cannot create or write there"),
    "learning_rate_inf": (["--learning_rate", "inf"], "--learning_rate must be a finite number above 0"),
    "weight_decay_negative": (["--weight_decay", "-0.1"], "--weight_decay must be a finite number at least 0"),
    "grad_clip_nan": (["--grad_clip", "nan"], "--grad_clip must be a number"),
    "muon_lr_nan": (["--muon_lr", "nan"], "--muon_lr must be a finite number above 0"),
    "dist_timeout_0": (["--dist_timeout", "0"], "--dist_timeout must be a finite number above 0"),
    "save_every_minutes_negative": (["--save_every_minutes", "-5"], "--save_every_minutes must be a finite number at least 0"),
    "val_fraction_nan": (["--val_fraction", "nan"], "--val_fraction must be in [0, 1)"),
    "eval_batches_0": (["--eval_batches", "0"], "--eval_batches must be at least 1, got 0"),
    "hidden_size_odd_heads": (["--hidden_size", "72"], "--hidden_size makes no model (each head has 9 dimensions"),  # heads of 9: RoPE
    "eval_interval_negative": (["--eval_interval", "-1"], "--eval_interval must be at least 0, got -1"),
    "seed_negative": (["--seed", "-1"], "--seed must be at least 0, got -1"),
    "seed_too_large": (["--seed", str(2 ** 32)], "--seed must be below 2**31"),
    "max_steps_negative": (["--max_steps", "-1"], "--max_steps must be at least 0, got -1"),
    "save_weight_with_a_folder": (["--save_weight", "runs/a"], "--save_weight 'runs/a' is a file name prefix"),
    "device_not_a_device": (["--device", "gpu0"], "--device gpu0: not a device this trainer runs on: pass --device cpu, cuda or cuda:N"),
    "device_cuda_out_of_range": (["--device", "cuda:99"], "--device cuda:99: "),
    # TMPDIR is not a flag, but --num_workers is what makes its length matter
    "tmpdir_too_long_for_workers": (["--num_workers", "1"], "--num_workers 1: the temp folder {tmp} (TMPDIR) is 101 bytes long"),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_flag_is_one_line_rc_2_before_any_step(case, tmp_path, capsys, monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    flags, expected = BAD_FLAGS[case]
    long_tmp = f"/tmp/{'t' * 96}"  # 101 bytes
    if "{tmp}" in expected:  # tempfile.gettempdir(), which multiprocessing uses, reads TMPDIR once
        monkeypatch.setattr(tempfile, "tempdir", long_tmp)
    flags = [f.format(file=a_file) for f in flags]
    expected = expected.format(file=a_file, tmp=long_tmp)
    argv = [*TINY, *out_args(tmp_path), "--max_steps", "2", "--save_interval", "1", *flags]
    with pytest.raises(SystemExit) as info:
        train_main(argv)
    captured = capsys.readouterr()
    assert info.value.code == 2
    assert captured.err.strip().splitlines() == [captured.err.strip()], captured.err
    assert captured.err.startswith("error: " + expected), captured.err
    assert "pass" in captured.err or "must" in captured.err  # says what to do
    assert not list(tmp_path.rglob("*.pth")), "a step ran"


# -----------------------------------------------------------------------------
# --device, on whatever this machine has (the CUDA answers are faked)

@pytest.mark.parametrize("device, launched_as, cuda, count, expected", [
    ("cpu", None, None, 0, torch.device("cpu")),
    (None, None, None, 0, torch.device("cpu")),
    ("cuda", None, None, 0, "this torch build has no CUDA: pass --device cpu"),
    ("cuda:0", None, "12.4", 0, "no GPU is visible: pass --device cpu"),
    ("cuda:1", None, "12.4", 1, "GPU 1 does not exist, 1 GPU(s) visible: pass --device cuda:0 to cuda:0"),
    ("cuda:0", None, "12.4", 1, torch.device("cuda", 0)),
    ("cuda", None, "12.4", 2, torch.device("cuda", 0)),
    (None, None, "12.4", 2, torch.device("cuda", 0)),
    ("cuda", 1, "12.4", 1, "LOCAL_RANK 1 and takes cuda:1, but 1 GPU(s) are visible"),
    (None, 1, "12.4", 1, "LOCAL_RANK 1 and takes cuda:1"),
    (None, 1, None, 0, torch.device("cpu")),  # no CUDA: the ranks take the CPU
    ("cuda", 1, "12.4", 2, torch.device("cuda", 1)),
    ("cuda:0", 1, "12.4", 2, torch.device("cuda", 1)),  # under a launcher, each rank its LOCAL_RANK's GPU
    ("mps", None, None, 0, "pass --device cpu, cuda or cuda:N"),
])
def test_resolve_device(monkeypatch, device, launched_as, cuda, count, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    if launched_as is not None:
        monkeypatch.setenv("RANK", str(launched_as))
        monkeypatch.setenv("LOCAL_RANK", str(launched_as))
    if isinstance(expected, torch.device):
        assert resolve_device(device) == expected
        return
    with pytest.raises(UserError) as info:
        resolve_device(device)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("script, argv, expected", [
    ("eval", ["--temperature", "nan", "--prompt", "x"], "--temperature must be a finite number >= 0"),
    ("eval", ["--top_p", "2", "--prompt", "x"], "--top_p must be in (0, 1]"),
    ("eval", ["--max_new_tokens", "-1", "--prompt", "x"], "--max_new_tokens, --top_k and --seed must not be negative"),
    ("eval", ["--device", "cuda:99", "--prompt", "x"], "--device cuda:99: "),
    ("convert", ["--atol", "nan"], "--atol must be a finite number >= 0"),
    ("convert", ["--out_dir", "/proc/nope", "--tokenizer_path", "none"], "export /proc/nope: no such file or directory"),
])
def test_script_flags_are_one_line_rc_2(weights, script, argv, expected, capsys):
    from scripts.convert_model import main as convert_main

    _, pth, _ = weights
    shape = [x for k, v in FLAGS.items() for x in (f"--{k}", str(v))]
    with pytest.raises(SystemExit) as info:
        (eval_main if script == "eval" else convert_main)(["--weight_path", str(pth), *shape, *argv])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err and expected in err, err


@pytest.mark.parametrize("script, argv, expected", [
    ("prepare_data", ["--chunk_lines", "0"], "--chunk_lines must be at least 1, got 0"),
    ("prepare_data", ["--shard_tokens", "-5"], "--shard_tokens must be at least 0, got -5"),
    ("prepare_data", ["--num_shards", "0"], "--num_shards must be at least 1, got 0"),
    ("prepare_data", ["--bogus"], "unrecognized arguments: --bogus"),
    ("split_corpus", ["--train_out", "same.jsonl", "--val_out", "same.jsonl"], "the three must be different files"),
    ("split_corpus", ["--train_out", "t.jsonl", "--val_out", "v.jsonl", "--bogus"], "unrecognized arguments: --bogus"),
    ("build_eval_task", ["--every", "0"], "--every must be at least 1, got 0"),
])
def test_data_script_flags_are_one_line(tmp_path, monkeypatch, capsys, script, argv, expected):
    import importlib

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(9)))
    out = ["--out_path", "c.bin"] if script == "prepare_data" else []
    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"scripts.{script}").main(["--data_path", str(corpus), *out, *argv])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err and expected in err, err
    assert not (tmp_path / "same.jsonl").exists()
