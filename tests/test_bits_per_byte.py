"""Bits per byte: dataset/token_bytes.py's byte lengths of the tokens, trainer/evaluate.py's
validation, and scripts/eval_llm.py's --ppl_data, which must agree."""
import math

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support import REPO_ROOT


def test_token_byte_lengths_spell_the_utf8_text():
    from dataset.lm_dataset import load_tokenizer
    from dataset.token_bytes import token_byte_lengths

    tok = load_tokenizer(REPO_ROOT / "model")
    lengths = token_byte_lengths(tok, 6400)
    assert lengths[[tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]].tolist() == [0, 0, 0]
    for text in ["héllo wörld", "def f(x):\n    return x", "你好，世界！ 🙂"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert lengths[ids].sum().item() == len(text.encode("utf-8"))


def test_bits_per_byte_hand_computed():
    """A model with zero logits predicts uniformly: every scored target costs ln(V) nats.
    "héllo" is 6 UTF-8 bytes; the targets are its tokens and the EOS (the EOS counts its
    NLL, 0 bytes), so bits/byte = (tokens + 1) * log2(V) / 6."""
    from contextlib import nullcontext

    from dataset.lm_dataset import load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from trainer.evaluate import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400))
    torch.nn.init.zeros_(model.lm_head.weight)  # tied: the embedding too, so every logit is 0
    text = "héllo"
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
    x = torch.tensor([ids + [tok.pad_token_id] * 3])
    targets = torch.tensor([ids[1:] + [-100] * 4])  # next-token targets: what every loader yields
    loss, bpb = evaluate(model, [(x, targets)], nullcontext(), "cpu", token_byte_lengths(tok, 6400))
    n_targets = len(ids) - 1
    assert loss == pytest.approx(math.log(6400), rel=1e-5)
    assert bpb == pytest.approx(n_targets * math.log2(6400) / 6, rel=1e-5)


def test_eval_llm_and_trainer_validation_agree_on_bits_per_byte(tmp_path):
    """The same documents scored by scripts/eval_llm.py and by the trainer's evaluate()."""
    import json
    from contextlib import nullcontext

    from torch.utils.data import DataLoader

    from dataset.lm_dataset import NextTokenTargets, PretrainDataset, load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from scripts.eval_llm import perplexity
    from trainer.evaluate import evaluate

    tok = load_tokenizer(REPO_ROOT / "model")
    docs = tmp_path / "val.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                            ["Return the value.", "Ünïcödé text 你好", "x = 1\ny = 2\n" * 3]))
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400)).eval()
    _, _, loss, bpb = perplexity(model, tok, docs, max_seq_len=64)
    loader = DataLoader(NextTokenTargets(PretrainDataset(str(docs), tok, 64)), batch_size=2)
    loss_t, bpb_t = evaluate(model, loader, nullcontext(), "cpu", token_byte_lengths(tok, 6400))
    assert bpb_t == pytest.approx(bpb, rel=1e-5) and loss_t == pytest.approx(loss, rel=1e-5)
