"""scripts/convert_model.py --format gguf, run in llama.cpp itself (llama-cpp-python, built from
the registry's source package: requirements-gguf.txt). Our tokenization, logits and greedy text
are the reference; llama.cpp must reproduce them from the file alone."""
import ctypes
import json
import os

import numpy as np
import pytest
import torch

from model.gguf_export import LLAMA_CPP_PRE_TOKENIZER, write_gguf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.convert_model import main, save_pth
from scripts.split_corpus import is_held_out
from tests.support.assertions import one_line_stop
from tests.support.tiny import CLI_FLAGS, FLAGS

INSTALL_HINT = os.environ.get("LLAMA_CPP_INSTALL_ERROR") or "pip install -r requirements-gguf.txt"
pytest.importorskip("gguf", reason=f"the gguf package is not installed: {INSTALL_HINT}")

# Texts where pre-tokenizers tend to part ways: unicode letters and digits, runs and kinds of
# whitespace, contractions, emoji, and special tokens written inside the text.
EDGE_CASES = [
    "  leading spaces, trailing   \n\n\n\t\ttabs\r\nand CRLF  ",
    "digits 1234567890 12,345.67 3.14159e-10 0x1F ١٢٣ ௧௨௩ ²³",
    "don't I'LL we've they'd it's 'quoted' \"double\" `back`",
    "你好，世界！MiniMind 是一个小模型。日本語のテキスト、한국어 텍스트",
    "emoji 🙂👍🏽 and zwj 👨‍👩‍👧 café naïve Ωmega ß ﬁ",
    "non\u00a0breaking\u2003em space\u3000ideographic\u200bzero width",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>",
    "def f(x):\n    return x**2  # comment\n\n\n    \n",
]


@pytest.fixture(scope="module")
def llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python is not installed ({e}): {INSTALL_HINT}")
    return llama_cpp


@pytest.fixture(scope="module")
def held_out_docs(demo_corpus):
    """The first 50 documents of the quick start's held-out split (every 25th)."""
    docs = []
    with open(demo_corpus, encoding="utf-8") as f:
        lines = (line for line in f if line.strip())
        for i, line in enumerate(lines):
            if is_held_out(i, 25):
                docs.append(json.loads(line)["text"])
            if len(docs) == 50:
                return docs
    raise AssertionError(f"{demo_corpus}: fewer than 50 held-out documents")


# A fixed cycle of 48 token ids that the models also learn: greedy decoding of a text model this
# small falls into "\n\n\n..." after a few tokens, while the cycle's continuation runs through
# 32 different tokens, so llama.cpp's decoding loop is compared on something that varies.
CYCLE = (torch.randperm(6397, generator=torch.Generator().manual_seed(0))[:48] + 3).tolist()


def train_on_text(model, tokenizer, demo_corpus, steps=60):
    """AdamW steps on the corpus's training documents (6 rows of a batch) and on CYCLE (2 rows)."""
    with open(demo_corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for i, line in enumerate(f) if i < 400 and not is_held_out(i, 25)]
    stream = torch.tensor(tokenizer("\n".join(texts), add_special_tokens=False).input_ids)
    cycle = torch.tensor(CYCLE * 3)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - 65, (6,), generator=gen).tolist()
        offsets = torch.randint(0, len(CYCLE), (2,), generator=gen).tolist()
        ids = torch.stack([stream[s : s + 64] for s in starts] + [cycle[o : o + 64] for o in offsets])
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def rounded_to_f16(model):
    # Our model in fp32 holding exactly the f16 file's weights: the comparison then measures
    # llama.cpp's arithmetic, not the rounding of the weights.
    copy = MiniMindForCausalLM(model.config)
    copy.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return copy.eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tokenizer, tokenizer_dir, demo_corpus):
    """A dense model and a top-2 MoE model trained a little on the corpus, written as GGUF."""
    root = tmp_path_factory.mktemp("gguf")
    torch.manual_seed(0)
    dense = train_on_text(MiniMindForCausalLM(MiniMindConfig(**FLAGS)), tokenizer, demo_corpus)
    torch.manual_seed(0)
    moe_config = MiniMindConfig(**FLAGS, use_moe=True, num_experts_per_tok=2)
    moe = train_on_text(MiniMindForCausalLM(moe_config), tokenizer, demo_corpus, steps=30)
    files = {}
    for name, model, kind in (("dense_f16", dense, "f16"), ("dense_q8_0", dense, "q8_0"), ("moe_f16", moe, "f16")):
        files[name] = root / f"{name}.gguf"
        arch = write_gguf(model, files[name], tokenizer_dir, kind)
        assert arch == ("qwen3moe" if name.startswith("moe") else "qwen3")
    return root, files, {"dense": rounded_to_f16(dense), "moe": rounded_to_f16(moe), "dense_fp32": dense}


def load(llama_cpp, path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=1, verbose=False, **kwargs)


def test_tokenization_equals_ours(llama_cpp, exports, held_out_docs, tokenizer):
    _, files, _ = exports
    llm = load(llama_cpp, files["dense_f16"], vocab_only=True)
    assert llm.metadata["tokenizer.ggml.pre"] == LLAMA_CPP_PRE_TOKENIZER
    texts = held_out_docs + EDGE_CASES
    total = 0
    for i, text in enumerate(texts):
        ours = tokenizer(text, add_special_tokens=False).input_ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert theirs == ours, f"text {i} {text[:60]!r}: first difference at token " \
                               f"{next(j for j, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b)}"
        # Back to text: llama.cpp's byte-level decoding of our ids gives the text again.
        assert llama_detokenize(llama_cpp, llm, ours).decode("utf-8") == text
        total += len(ours)
    assert total > 5000  # the documents are real text, not a handful of tokens
    assert (llm.token_bos(), llm.token_eos()) == (1, 2)


def llama_detokenize(llama_cpp, llm, ids):
    # llama.cpp's own call: llama-cpp-python's Llama.detokenize decodes token by token into a
    # 32-byte buffer and drops longer tokens (we have a 37-byte one, a row of an ASCII table).
    text = ctypes.create_string_buffer(64 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(llm._model.vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), text,
                                   len(text), False, True)
    assert 0 <= n <= len(text)
    return text.raw[:n]


def llama_logits(llama_cpp, path, ids):
    llm = load(llama_cpp, path, logits_all=True)
    llm.eval(ids)
    return llm, torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def doc_ids(tokenizer, held_out_docs, n=200):
    ids = tokenizer(held_out_docs[3] + held_out_docs[4], add_special_tokens=False).input_ids[:n]
    assert len(ids) == n
    return ids


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_f16_logits_agree_with_ours(llama_cpp, exports, held_out_docs, tokenizer, name):
    _, files, models = exports
    ids = doc_ids(tokenizer, held_out_docs)
    llm, theirs = llama_logits(llama_cpp, files[f"{name}_f16"], ids)
    assert llm.metadata["general.architecture"] == ("qwen3moe" if name == "moe" else "qwen3")
    with torch.no_grad():
        ours = models[name](torch.tensor([ids])).logits[0]
    diff = (theirs - ours).abs().max().item()
    spread = ours.std().item()
    print(f"{name} f16: max logit diff {diff:.3g}, logit std {spread:.3g}, max |logit| {ours.abs().max():.3g}")
    # llama.cpp rounds activations to f16 inside its f16 matmuls: ~1e-3 here, against logits that
    # spread over several units (so a wrong weight layout or RoPE would be off by ~1).
    assert spread > 0.5 and diff <= 1e-2
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.98


def test_greedy_continuation_equals_ours(llama_cpp, exports, held_out_docs, tokenizer):
    _, files, models = exports
    llm = load(llama_cpp, files["dense_f16"])
    for prompt in (doc_ids(tokenizer, held_out_docs, n=24), CYCLE[:8]):
        ours = models["dense"].generate(torch.tensor([prompt]), max_new_tokens=32, eos_token_id=-1)
        ours = ours[0, len(prompt) :].tolist()
        llm.reset()
        theirs = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            theirs.append(token)
            if len(theirs) == len(ours):
                break
        print("greedy:", repr(tokenizer.decode(ours)))
        assert theirs == ours
    assert len(set(ours)) >= 16  # the cycle's continuation: many different tokens, not one repeated


def test_q8_0_loads_and_runs(llama_cpp, exports, held_out_docs, tokenizer):
    _, files, models = exports
    assert files["dense_q8_0"].stat().st_size < 0.7 * files["dense_f16"].stat().st_size
    ids = doc_ids(tokenizer, held_out_docs)
    llm, theirs = llama_logits(llama_cpp, files["dense_q8_0"], ids)
    assert llm.metadata["general.file_type"] == "7"  # MOSTLY_Q8_0
    with torch.no_grad():
        ours = models["dense_fp32"](torch.tensor([ids])).logits[0]
    diff = (theirs - ours).abs().max().item()
    print(f"q8_0: max logit diff {diff:.3g}")
    assert diff <= 0.15  # 8-bit weights: ~3e-2 here, an order above f16's, still far below a broken file
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9


def test_chat_template_is_carried(llama_cpp, exports, tokenizer):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    _, files, _ = exports
    llm = load(llama_cpp, files["dense_f16"], vocab_only=True)
    template = llm.metadata["tokenizer.chat_template"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    rendered = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<|im_start|>")(messages=messages)
    assert rendered.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_cli_writes_gguf_and_refuses_top1_moe(tmp_path, capsys):
    pth = tmp_path / "pretrain_64.pth"
    save_pth(MiniMindForCausalLM(MiniMindConfig(**FLAGS)).state_dict(), pth)
    main(["--weight_path", str(pth), *CLI_FLAGS, "--format", "gguf", "--gguf_type", "q8_0",
          "--out_path", str(tmp_path / "m.gguf")])
    out = capsys.readouterr().out
    assert "as GGUF q8_0, llama.cpp architecture qwen3" in out and (tmp_path / "m.gguf").is_file()

    def error_of(*argv):
        return one_line_stop(main, capsys, *argv)

    # The trainer's MoE sends each token to one expert, unrenormalised: llama.cpp would compute otherwise.
    moe_pth = tmp_path / "pretrain_64_moe.pth"
    save_pth(MiniMindForCausalLM(MiniMindConfig(**FLAGS, use_moe=True)).state_dict(), moe_pth)
    err = error_of("--weight_path", str(moe_pth), *CLI_FLAGS, "--use_moe", "1", "--format", "gguf",
                   "--out_path", str(tmp_path / "moe.gguf"))
    assert "qwen3moe always renormalises" in err and not (tmp_path / "moe.gguf").exists()
    assert "needs the tokenizer" in error_of("--weight_path", str(pth), *CLI_FLAGS, "--format", "gguf",
                                             "--tokenizer_path", "none", "--out_path", str(tmp_path / "n.gguf"))
    assert "--out_path only goes with" in error_of("--weight_path", str(pth), "--out_path", str(tmp_path / "x"))
    assert "--gguf_type only goes with" in error_of("--weight_path", str(pth), "--gguf_type", "q8_0")


def test_read_back_check_catches_a_wrong_tensor(exports):
    import gguf

    from model.gguf_export import GGUFExportError, gguf_tensors, verify_gguf

    _, files, models = exports

    tensors = gguf_tensors(models["dense_fp32"], gguf.MODEL_ARCH.QWEN3, "f16")  # what write_gguf wrote
    verify_gguf(files["dense_f16"], "qwen3", tensors, 6400)  # the file holds what was meant
    array, qtype, shape = tensors["blk.1.attn_q.weight"]
    changed = array.copy()
    changed[0, 0] += 1
    with pytest.raises(GGUFExportError, match="blk.1.attn_q.weight .*other bytes"):
        verify_gguf(files["dense_f16"], "qwen3", {**tensors, "blk.1.attn_q.weight": (changed, qtype, shape)}, 6400)
    with pytest.raises(GGUFExportError, match="not 'qwen3moe'"):
        verify_gguf(files["dense_f16"], "qwen3moe", tensors, 6400)
