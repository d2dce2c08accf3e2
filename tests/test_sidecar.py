"""The model config beside the weights: the trainer writes `{prefix}.json` next to
`{prefix}.pth`, and eval_llm.py, convert_model.py and --from_weight read it, so that no
shape flags are needed. The .pth stays MiniMind's plain half-precision state_dict, and
a .pth without a sidecar (MiniMind's own) still loads with flags, as before.

One in-process training run (a single step) stands for "what the trainer writes";
everything else reads its files in-process.
"""
import json
from pathlib import Path

import pytest
import torch

from model.model_minimind import MiniMindConfig
from common.errors import UserError, WeightsError
from model.weights import load_model, read_checkpoint, sidecar_path, sidecar_text
from scripts.convert_model import main as convert_main, save_pth
from scripts.eval_llm import main as eval_main
from tests.support.jobs import run_trainer
from tests.support.run_outputs import out_args
from tests.support.tiny import TINY, ensure_demo_corpus
from trainer.config import parse_config
from model.weights import write_weights
from trainer.trainer_utils import init_model, model_config

# Not the trainer's defaults (hidden 512, 8 layers), so a load that ignored the sidecar would fail.
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2}


def logits_of(model):
    ids = torch.randint(3, 6400, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def one_error_line(capsys, call):
    with pytest.raises(SystemExit) as exc:
        call()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Start weights written as the trainer writes them (model/weights.py's write_weights), then one real training step
    from them (--from_weight, no shape flags) in-process. Returns the run's --save_dir."""
    work = tmp_path_factory.mktemp("sidecar")
    torch.manual_seed(0)
    start = init_model(MiniMindConfig(**SHAPE))
    write_weights(start.state_dict(), start.config, str(work / "start" / "start_64.pth"))
    corpus = work / "small.jsonl"
    corpus.write_text("".join(ensure_demo_corpus().open().readlines()[:200]))

    shape_free = TINY[4:]
    assert TINY[:4] == ["--hidden_size", "64", "--num_hidden_layers", "2"]
    result = run_trainer([*shape_free, "--from_weight", str(work / "start" / "start_64.pth"),
                               "--data_path", str(corpus), "--max_steps", "1", "--save_interval", "1",
                               *out_args(work / "run")], work / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    return work / "run" / "out"


def test_trainer_writes_plain_weights_and_a_json_config(trained):
    run = trained
    # Named from the sidecar's hidden 64: a default-flags run would be pretrain_512.
    assert sorted(p.name for p in run.glob("pretrain_*")) == ["pretrain_64.json", "pretrain_64.pth",
                                                              "pretrain_64_metrics.jsonl"]
    weights = torch.load(run / "pretrain_64.pth", weights_only=True)  # MiniMind's format, untouched
    assert all(torch.is_tensor(v) and v.dtype == torch.float16 for v in weights.values())
    assert "model.embed_tokens.weight" in weights
    stored = json.loads((run / "pretrain_64.json").read_text())
    assert stored["model_type"] == "minimind"
    assert {k: stored[k] for k in SHAPE} == SHAPE


def test_eval_llm_needs_no_shape_flags(trained, tmp_path, capsys):
    pth = trained / "pretrain_64.pth"
    from_sidecar = load_model(pth)[0]  # what eval_llm calls with no flags given
    from_flags = load_model(pth, **SHAPE)[0]
    assert from_sidecar.config.hidden_size == 64
    assert logits_of(from_sidecar).equal(logits_of(from_flags))

    held_out = tmp_path / "val.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("Return the value.", "Open a file.")))
    ppl = ["--weight_path", str(pth), "--ppl_data", str(held_out), "--device", "cpu"]
    eval_main(ppl)
    without_flags = capsys.readouterr().out
    eval_main([*ppl, "--hidden_size", "64", "--num_hidden_layers", "2"])  # agreeing flags are fine
    assert "loss=" in without_flags and capsys.readouterr().out == without_flags


def test_a_conflicting_flag_is_one_line(trained, capsys):
    pth = trained / "pretrain_64.pth"
    err = one_error_line(capsys, lambda: eval_main(["--weight_path", str(pth), "--hidden_size", "128",
                                                    "--prompt", "x", "--device", "cpu"]))
    assert "--hidden_size 64 but --hidden_size 128" in err and str(pth) in err
    args = parse_config(["--from_weight", str(pth), "--num_hidden_layers", "4"])
    with pytest.raises(UserError, match="--num_hidden_layers 2 but --num_hidden_layers 4"):
        model_config(*args)


def test_from_weight_takes_the_shape_from_the_sidecar(trained):
    pth = trained / "pretrain_64.pth"
    args = parse_config(["--from_weight", str(pth), "--num_hidden_layers", "2"])  # typed and agreeing
    config = model_config(*args)
    assert (config.hidden_size, config.num_hidden_layers, config.flash_attn) == (64, 2, True)
    model = init_model(config, str(pth)).eval()
    assert logits_of(model).equal(logits_of(load_model(pth)[0]))


def test_a_run_shaped_by_its_from_weight_records_that_shape_and_resumes_with_it_typed(trained, tmp_path):
    """The checkpoint's stored config holds the shape the sidecar gave (64 x 2), not the flags'
    defaults, so a resume that types it is the same run, not a contradiction."""
    import shutil

    work = trained.parent.parent
    run = tmp_path / "run"
    shutil.copytree(trained.parent, run, symlinks=True)
    [record] = [json.loads(p.read_text()) for p in (run / "ckpt").glob("*_resume_step*.json")]
    assert {name: record["config"]["model"][name] for name in SHAPE} == SHAPE
    resumed = run_trainer([*TINY, "--from_weight", str(work / "start" / "start_64.pth"), "--data_path",
                           str(work / "small.jsonl"), "--max_steps", "2", "--from_resume", "1", *out_args(run)], run)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout and "at step 1/2" in resumed.stdout


def test_a_resume_needs_no_from_weight_file_any_more(trained, tmp_path):
    """The checkpoint holds the weights and its record the shape: a --from_weight file moved or
    deleted since the run began costs nothing (a fine-tune whose pretrained weights were replaced).
    The shape flags are typed: without the file they name the checkpoints (pretrain_64)."""
    import shutil

    work = trained.parent.parent
    run = tmp_path / "run"
    shutil.copytree(trained.parent, run, symlinks=True)
    resumed = run_trainer([*TINY, "--from_weight", str(tmp_path / "gone" / "start_64.pth"), "--data_path",
                           str(work / "small.jsonl"), "--max_steps", "2", "--from_resume", "1", *out_args(run)], run)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "at step 1/2" in resumed.stdout and "loaded weights from" not in resumed.stdout
    untyped = run_trainer([*TINY[4:], "--from_weight", str(tmp_path / "gone" / "start_64.pth"), "--data_path",
                           str(work / "small.jsonl"), "--max_steps", "3", "--from_resume", "1", *out_args(run)], run)
    assert untyped.returncode == 2
    assert ("holds no checkpoint of pretrain_768 to resume: where that file gave the run its shape, pass the shape "
            "flags") in untyped.stdout


def test_a_pth_without_sidecar_still_goes_by_the_flags(trained, tmp_path, capsys):
    bare = tmp_path / "minimind.pth"  # MiniMind's own files have no .json
    bare.write_bytes((trained / "pretrain_64.pth").read_bytes())
    assert read_checkpoint(bare)[1] is None
    with pytest.raises(WeightsError, match="weights do not fit the model flags"):
        load_model(bare)  # the defaults, hidden 512 x 8
    assert logits_of(load_model(bare, **SHAPE)[0]).equal(logits_of(load_model(trained / "pretrain_64.pth")[0]))
    args = parse_config(["--from_weight", str(bare), "--hidden_size", "64"])
    assert model_config(*args).num_hidden_layers == 8  # the flag's default, as before


@pytest.mark.parametrize("text, says", [
    ("{\"hidden_size\": 64,", "not readable JSON"),
    ("[64, 2]", "not a MiniMind model config (a JSON list"),
    ("{\"model_type\": \"qwen3\", \"hidden_size\": 64}", "model_type 'qwen3'"),
    ("{\"hidden_size\": \"64\"}", "hidden_size is '64'"),
    ("{\"hidden_size\": 64, \"intermediate_size\": -1}", "intermediate_size is -1"),
    ("{\"hidden_size\": 64, \"max_position_embeddings\": 0}", "max_position_embeddings is 0"),
    ("{\"hidden_size\": 64, \"num_attention_heads\": 8, \"num_key_value_heads\": 3}", "not a multiple"),
])
def test_a_bad_sidecar_is_one_line(trained, tmp_path, capsys, text, says):
    pth = tmp_path / "w.pth"
    pth.write_bytes((trained / "pretrain_64.pth").read_bytes())
    (tmp_path / "w.json").write_text(text)
    with pytest.raises(WeightsError, match="w.json: ") as exc:
        load_model(pth, **SHAPE)  # even with the right flags: the file is wrong, so say so
    assert says in str(exc.value) and "\n" not in str(exc.value)
    err = one_error_line(capsys, lambda: eval_main(["--weight_path", str(pth), "--prompt", "x", "--device", "cpu"]))
    assert str(tmp_path / "w.json") in err
    with pytest.raises(UserError, match="w.json: "):
        args = parse_config(["--from_weight", str(pth)])
        model_config(*args)


def test_safetensors_weights_have_a_sidecar_too(trained, tmp_path):
    reference = load_model(trained / "pretrain_64.pth")[0]
    path = tmp_path / "w.safetensors"
    save_pth(reference.state_dict(), path)
    sidecar_path(path).write_text(sidecar_text(reference.config))
    assert sidecar_path(path) == tmp_path / "w.json"
    assert logits_of(load_model(path)[0]).equal(logits_of(reference))


def test_convert_model_round_trip_needs_no_flags(trained, tmp_path, capsys):
    pth = trained / "pretrain_64.pth"
    convert_main(["--weight_path", str(pth), "--out_dir", str(tmp_path / "hf"), "--tokenizer_path", "none"])
    convert_main(["--to_pth", "--hf_dir", str(tmp_path / "hf"), "--out_path", str(tmp_path / "back.pth")])
    assert Path(tmp_path / "back.json").is_file()
    assert logits_of(load_model(tmp_path / "back.pth")[0]).equal(logits_of(load_model(pth)[0]))


@pytest.mark.parametrize("flags, says", [
    (["--num_attention_heads", "0"], "num_attention_heads is 0"),
    (["--hidden_size", "-8"], "hidden_size is -8"),
    (["--hidden_size", "72"], "each head has 9 dimensions"),  # 8 heads by default
    (["--hidden_size", "4"], "each head has 0 dimensions"),
])
def test_shape_flags_that_make_no_model_are_one_line(trained, tmp_path, capsys, flags, says):
    """A .pth without a config beside it goes by the flags: flags that describe no model stop in one
    line, before any tensor is built."""
    bare = tmp_path / "minimind.pth"
    bare.write_bytes((trained / "pretrain_64.pth").read_bytes())
    err = one_error_line(capsys, lambda: eval_main(["--weight_path", str(bare), *flags, "--prompt", "x",
                                                    "--device", "cpu"]))
    assert says in err and "the shape flags make no model" in err


def test_a_stored_config_that_makes_no_model_is_one_line(trained, tmp_path):
    """A resume checkpoint carries its model config inside: checked like a sidecar."""
    import torch

    from model.weights import load_model as load

    state = torch.load(trained / "pretrain_64.pth", weights_only=True)
    bad = tmp_path / "resume.pth"
    torch.save({"model": state, "model_config": {"hidden_size": 64, "num_attention_heads": 0}}, bad)
    with pytest.raises(WeightsError, match="stored model config makes no model \\(num_attention_heads is 0"):
        load(bad)
