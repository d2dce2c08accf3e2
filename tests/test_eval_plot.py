"""scripts/eval_llm.py (generation, streaming, perplexity) and scripts/plot_loss.py."""
import io
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from model.weights import load_model
from scripts.convert_model import save_pth
from scripts.eval_llm import TextStreamer, main as eval_main, perplexity
from scripts.plot_loss import main as plot_main
from tests.support.tiny import CLI_FLAGS, FLAGS, train_tiny

DOCS = ["hello world and the quick brown fox", "你好，世界！", "", "a b c d e f g h i j k l m n o p " * 20]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("eval")
    tok_dir = tiny_tokenizer_dir
    pth = root / "pretrain_64.pth"
    save_pth(train_tiny(use_moe=False).state_dict(), pth)
    data = root / "val.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in DOCS), encoding="utf-8")
    return root, tok_dir, pth, data


def test_eval_cli_generates_and_measures_perplexity(setup, capsys):
    _, tok_dir, pth, data = setup
    capsys.readouterr()
    eval_main(["--weight_path", str(pth), *CLI_FLAGS, "--tokenizer_path", str(tok_dir), "--prompt", "hello",
               "--prompt", "你好", "--max_new_tokens", "12", "--ppl_data", str(data), "--max_seq_len", "64",
               "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()  # it returned: the CLI's exit code 0
    match = re.fullmatch(r"ppl_data=(\S+) docs=(\d+) tokens=(\d+) loss=(\S+) ppl=(\S+) bits_per_byte=(\S+)", lines[0])
    assert match, lines[0]
    docs, tokens, loss, ppl = int(match[2]), int(match[3]), float(match[4]), float(match[5])
    assert 0 < float(match[6]) < loss  # a byte-level BPE token spells at least one byte, mostly more
    assert docs == len(DOCS) and tokens >= docs and math.isfinite(loss) and loss > 0
    assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert loss == pytest.approx(reference_loss(pth, tok_dir, max_seq_len=64), rel=1e-4)
    # One line per prompt: the prompt echoed, then the streamed continuation.
    assert lines[1].startswith("hello") and len(lines[1]) > len("hello")
    assert lines[2].startswith("你好") and len(lines[2]) > len("你好")


def test_lengths_past_the_model_s_context_are_cut_or_one_line(setup, tmp_path, capsys):
    """A model of 32 positions: a continuation stops where the context is full (a note says so);
    --max_seq_len past it, or a prompt that fills it, is one line, not a traceback."""
    from model.model_minimind import MiniMindConfig
    from model.weights import write_weights

    _, tok_dir, pth, data = setup
    short = tmp_path / "short_64.pth"
    write_weights(load_model(pth, **FLAGS)[0].state_dict(), MiniMindConfig(**FLAGS, max_position_embeddings=32),
                  str(short))
    run = ["--weight_path", str(short), "--tokenizer_path", str(tok_dir), "--device", "cpu"]
    capsys.readouterr()
    eval_main([*run, "--prompt", "hello", "--max_new_tokens", "100"])
    out, err = capsys.readouterr()
    prompt_tokens = int(re.search(r"with the prompt's (\d+) tokens", err)[1])
    assert f"note: --max_new_tokens 100 cut to {32 - prompt_tokens}" in err and out.startswith("hello")
    with pytest.raises(SystemExit) as stop:
        eval_main([*run, "--ppl_data", str(data), "--max_seq_len", "64"])
    assert stop.value.code == 2
    assert "--max_seq_len 64 is longer than the context of the model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_main([*run, "--prompt", "hello " * 40])
    err = capsys.readouterr().err
    assert "and the model's context holds 32: shorten it" in err and "Traceback" not in err


def reference_loss(pth, tok_dir, max_seq_len):
    """Mean next-token loss over all documents, one document at a time, by hand."""
    model, _ = load_model(pth, **FLAGS)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    total, count = 0.0, 0
    for text in DOCS:
        ids = [1] + tok(text, add_special_tokens=False).input_ids[: max_seq_len - 2] + [2]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return total / count


def test_perplexity_max_docs_and_batching_agree(setup):
    _, tok_dir, pth, data = setup
    model, _ = load_model(pth, **FLAGS)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    one_by_one = perplexity(model, tok, data, batch_size=1)
    batched = perplexity(model, tok, data, batch_size=3)
    assert one_by_one[:2] == batched[:2]
    assert one_by_one[2] == pytest.approx(batched[2], rel=1e-5)
    assert perplexity(model, tok, data, max_docs=2)[0] == 2


def test_streamer_prints_exactly_the_decoded_continuation(setup):
    _, tok_dir, pth, _ = setup
    tok = AutoTokenizer.from_pretrained(tok_dir)
    # Multi-byte characters are split over several byte-level tokens; the streamer
    # must hold them back until they are complete.
    ids = tok("你好，世界！ hello 小模型", add_special_tokens=False).input_ids + [2]
    out = io.StringIO()
    streamer = TextStreamer(tok, out)
    streamer.put(torch.tensor([[1]]))  # the prompt, as generate() hands it over first: not printed
    chunks = []
    for token in ids:
        streamer.put(torch.tensor([token]))
        chunks.append(out.getvalue())
    streamer.end()
    assert out.getvalue() == "你好，世界！ hello 小模型\n"
    assert all("\ufffd" not in chunk for chunk in chunks)

    # And with the real generate loop: what is printed is what was generated.
    model, _ = load_model(pth, **FLAGS)
    out = io.StringIO()
    prompt = torch.tensor([[1] + tok("hello", add_special_tokens=False).input_ids])
    tokens = model.generate(prompt, max_new_tokens=10, streamer=TextStreamer(tok, out))
    assert out.getvalue() == tok.decode(tokens[0, prompt.shape[1]:], skip_special_tokens=True) + "\n"


def test_eval_bad_input_is_one_line(setup, capsys):

    root, tok_dir, pth, _ = setup
    for argv, expected in [
        (["--weight_path", str(root / "nope.pth"), "--ppl_data", str(root / "val.jsonl")], "not found"),
        (["--weight_path", str(pth), "--ppl_data", str(root / "nope.jsonl")], "--ppl_data"),
        (["--weight_path", str(pth), "--hidden_size", "32", "--prompt", "x"], "do not fit the model flags"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            eval_main([*argv, "--tokenizer_path", str(tok_dir)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in err and expected in err, err


# -----------------------------------------------------------------------------
# plot_loss

def write_metrics(path, base):
    rows = []
    for step in range(1, 41):
        rows.append({"kind": "train", "step": step, "epoch": 0, "tokens_seen": step * 2048, "loss": base / step ** 0.3,
                     "aux_loss": 0.0, "lr": 1e-3 * min(1.0, step / 5), "tokens_per_s": 5e3, "nonpad_tokens_per_s": 4e3})
        if step % 10 == 0:
            rows.append({"kind": "val", "step": step, "tokens_seen": step * 2048, "val_loss": base / step ** 0.3 + 0.1})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_loss_writes_one_png_for_two_runs(tmp_path, capsys):
    write_metrics(tmp_path / "pretrain_64_metrics.jsonl", 9.0)
    write_metrics(tmp_path / "pretrain_64_moe_metrics.jsonl", 8.5)
    plot_main(["--save_dir", str(tmp_path)])
    png = tmp_path / "loss.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    out = tmp_path / "sub" / "one.png"
    plot_main(["--metrics", str(tmp_path / "pretrain_64_metrics.jsonl"), "--out", str(out)])
    assert out.is_file()


def test_plot_loss_without_metrics_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot_main(["--save_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "no *_metrics.jsonl" in err
