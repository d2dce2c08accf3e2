"""scripts/convert_model.py: .pth -> HF folders (native Qwen3 / Qwen3-MoE, minimind remote code) -> .pth."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.hf_format import hf_to_state_dict
from model.weights import load_model, load_weights
from scripts.convert_model import export_minimind, export_native, main, save_pth
from tests.support.assertions import one_line_stop
from tests.support.tiny import CLI_FLAGS, FLAGS, train_tiny


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer_dir):
    """Trained tiny dense and MoE models saved as .pth, exported in every supported way."""
    root = tmp_path_factory.mktemp("convert")
    tok_dir = tiny_tokenizer_dir
    runs = {}
    for use_moe in (False, True):
        name = "moe" if use_moe else "dense"
        pth = root / f"pretrain_64{'_moe' if use_moe else ''}.pth"
        save_pth(train_tiny(use_moe).state_dict(), pth)
        # The reference is what the rest of the project would load from that .pth.
        model, _ = load_model(pth, **FLAGS, use_moe=int(use_moe))
        native, minimind = root / f"native_{name}", root / f"minimind_{name}"
        checks = (export_native(model, native, tok_dir), export_minimind(model, minimind, tok_dir))
        runs[name] = dict(pth=pth, model=model, native=native, minimind=minimind, checks=checks)
    return root, tok_dir, runs


def probe_ids():
    return torch.randint(3, 6400, (2, 20), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_native_export_loads_in_stock_transformers(work, name):
    _, tok_dir, runs = work
    run = runs[name]
    assert max(check.max_logit_diff for check in run["checks"]) <= 1e-4
    config = json.loads((run["native"] / "config.json").read_text())
    assert config["model_type"] == ("qwen3_moe" if name == "moe" else "qwen3") and "auto_map" not in config
    hf = AutoModelForCausalLM.from_pretrained(run["native"], dtype=torch.float32).eval()  # no remote code
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if name == "moe" else "Qwen3ForCausalLM")
    assert run["checks"][0].loaded_as == type(hf).__name__  # the export's own check loaded the same class
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = probe_ids()
    with torch.no_grad():
        diff = (hf(ids).logits - run["model"](ids).logits).abs().max().item()
    print(f"native {name}: max logit diff {diff:.3g}")
    assert diff <= 1e-4
    prompt = ids[:1, :6]
    ours = run["model"].generate(prompt, max_new_tokens=12)
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)
    tokenizer = AutoTokenizer.from_pretrained(run["native"])
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode(tokenizer("你好 hello", add_special_tokens=False).input_ids) == "你好 hello"


REMOTE_PROBE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
results = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.load(sys.argv[1])
    with torch.no_grad():
        logits = model(ids).logits
    results[folder] = dict(
        module=type(model).__module__,
        logits=logits,
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        greedy=model.generate(ids[:1, :6], max_new_tokens=12),
        text=tok.decode(tok("hi there").input_ids),
    )
torch.save(results, sys.argv[1] + ".out")
"""


@pytest.mark.slow
def test_minimind_export_loads_with_remote_code_from_anywhere(work, tmp_path):
    root, _, runs = work
    ids_file = tmp_path / "ids.pt"
    torch.save(probe_ids(), ids_file)
    folders = [str(runs[name]["minimind"]) for name in ("dense", "moe")]
    # A fresh interpreter in another directory, without the repo on sys.path: only
    # the files inside the exported folders can provide the model code.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    subprocess.run([sys.executable, "-c", textwrap.dedent(REMOTE_PROBE), str(ids_file), *folders],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    results = torch.load(str(ids_file) + ".out")
    for name, folder in zip(("dense", "moe"), folders):
        run, got = runs[name], results[folder]
        assert got["module"].startswith("transformers_modules.")
        assert got["tied"]
        assert max(check.max_logit_diff for check in run["checks"]) <= 1e-4
        assert run["checks"][1].loaded_as == "MiniMindForCausalLM"
        with torch.no_grad():
            assert (got["logits"] - run["model"](probe_ids()).logits).abs().max() <= 1e-4
        assert torch.equal(got["greedy"], run["model"].generate(probe_ids()[:1, :6], max_new_tokens=12))
        assert got["text"] == "hi there"


def test_round_trip_to_pth_gives_the_original_weights(work, capsys):
    root, _, runs = work
    for name, run in runs.items():
        original = load_weights(run["pth"])
        for kind in ("native", "minimind"):
            out = root / f"back_{kind}_{name}.pth"
            main(["--to_pth", "--hf_dir", str(run[kind]), "--out_path", str(out)])
            back = load_weights(out)
            assert back.keys() == original.keys()
            assert all(back[k].dtype == torch.float16 and torch.equal(back[k], original[k]) for k in original)
    assert "--use_moe 1" in capsys.readouterr().out


def test_hf_to_state_dict_reads_fused_experts(work, tmp_path):
    # transformers' in-memory Qwen3-MoE layout (fused 3-D expert tensors), saved raw.
    from safetensors.torch import save_file

    _, _, runs = work
    run = runs["moe"]
    hf = AutoModelForCausalLM.from_pretrained(run["native"], dtype=torch.float32)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    (tmp_path / "config.json").write_text((run["native"] / "config.json").read_text())
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    state, config = hf_to_state_dict(tmp_path)
    original = load_weights(run["pth"])
    assert config.use_moe and state.keys() == original.keys()
    assert all(torch.equal(state[k].half(), original[k]) for k in original)


def test_cli_export_and_bad_input(work, tmp_path, capsys):
    root, tok_dir, runs = work
    pth = str(runs["dense"]["pth"])
    main(["--weight_path", pth, *CLI_FLAGS, "--out_dir", str(tmp_path / "cli"), "--tokenizer_path", str(tok_dir)])
    assert f"verified: AutoModelForCausalLM.from_pretrained({str(tmp_path / 'cli')!r}) -> Qwen3ForCausalLM, " \
           "max logit diff vs our model = " in capsys.readouterr().out

    def error_of(*argv):
        return one_line_stop(main, capsys, *argv)

    # Flags that do not describe the weights: name the tensor and the flags that would fit.
    err = error_of("--weight_path", pth, "--hidden_size", "128", "--num_hidden_layers", "2",
                   "--out_dir", str(tmp_path / "x"))
    assert "do not fit the model flags" in err and "--hidden_size 64" in err
    # A resume checkpoint's config wins; contradicting flags are refused.
    model = runs["moe"]["model"]
    resume = tmp_path / "resume.pth"
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict(), "step": 4}, resume)
    err = error_of("--weight_path", str(resume), "--num_hidden_layers", "3", "--out_dir", str(tmp_path / "x"))
    assert "trained with --num_hidden_layers 2 but --num_hidden_layers 3" in err
    main(["--weight_path", str(resume), "--use_moe", "1", "--out_dir", str(tmp_path / "r"), "--tokenizer_path", "none"])
    assert "Qwen3-MoE" in capsys.readouterr().out
    assert "not found" in error_of("--weight_path", str(tmp_path / "missing.pth"))
    assert "no tokenizer files" in error_of("--weight_path", pth, *CLI_FLAGS, "--out_dir", str(tmp_path / "t"),
                                            "--tokenizer_path", str(tmp_path))
    assert not (tmp_path / "t").exists()  # refused before writing anything
    assert "--to_pth needs" in error_of("--to_pth", "--hf_dir", str(tmp_path))
    (tmp_path / "back.json").write_text("{}")  # the weights would have gone here, then their config over them
    assert "pass a path ending in .pth (or .safetensors)" in error_of("--to_pth", "--hf_dir", str(tmp_path), "--out_path",
                                                     str(tmp_path / "back.json"))
    assert (tmp_path / "back.json").read_text() == "{}"
    assert "no config.json" in error_of("--to_pth", "--hf_dir", str(tmp_path), "--out_path", str(tmp_path / "y.pth"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')  # cut short
    assert "config.json: the model config is not readable JSON" in error_of(
        "--to_pth", "--hf_dir", str(tmp_path), "--out_path", str(tmp_path / "y.pth"))


def test_an_export_into_the_current_folder_and_none_into_the_root(work, tmp_path, capsys, monkeypatch):
    """--out_dir . stages beside the current folder and lands in it; --out_dir / is one line."""
    root, tok_dir, runs = work
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    main(["--weight_path", str(runs["dense"]["pth"]), *CLI_FLAGS, "--out_dir", ".", "--tokenizer_path", str(tok_dir)])
    assert "verified: AutoModelForCausalLM.from_pretrained(" in capsys.readouterr().out
    assert (here / "config.json").is_file() and (here / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]  # the staging folder is gone
    err = one_line_stop(main, capsys, "--weight_path", str(runs["dense"]["pth"]), *CLI_FLAGS, "--out_dir", "/")
    assert "--out_dir /: name a folder to export into" in err


def test_an_export_folder_that_cannot_be_made_names_the_flag_it_came_from(tmp_path):
    """The server exports into --cache_dir through the same staging folder: its error line names
    --cache_dir, not convert_model.py's --out_dir."""
    from common.errors import StorageError
    from scripts.convert_model import export_folder

    (tmp_path / "afile").write_text("")
    with pytest.raises(StorageError, match=r"pass another --cache_dir") as info:
        with export_folder(tmp_path / "afile" / "cache" / "digest", 1, "--cache_dir"):
            pass
    assert "--out_dir" not in str(info.value)
