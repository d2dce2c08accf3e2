"""Bits per byte: dataset/token_bytes.py's byte lengths of the tokens, trainer/evaluate.py's
validation, and scripts/eval_llm.py's --ppl_data, which must agree."""
import math
from pathlib import Path

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


@pytest.mark.parametrize("trains_with_doc_mask", [False, True])
def test_validation_scores_each_packed_document_alone(trains_with_doc_mask, monkeypatch):
    """A packed held-out window of two documents scores exactly what the two documents score
    each in its own row, whether or not the run trains with --doc_mask, and not what the window
    scores with plain causal attention (the second document would see the first). A run that
    trains without FlexAttention is handed the dense mask (flex=False), on CUDA too."""
    from contextlib import nullcontext

    import model.document_mask as document_mask
    from dataset.lm_dataset import load_tokenizer
    from dataset.token_bytes import token_byte_lengths
    from trainer.evaluate import evaluate, validate
    from trainer.step import TrainParts

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=6400)).eval()
    bos, eos, pad = 1, 2, 0
    first, second = [bos, 40, 41, 42, 43, eos], [bos, 50, 51, eos]
    window = torch.tensor([first + second])
    packed = [(window[:, :-1], window[:, 1:])]
    rows = torch.tensor([first, second + [pad] * 2])
    # The first's EOS predicts the BOS after it, as in the window; the second's padding scores nothing.
    targets = torch.cat([rows[:, 1:], torch.tensor([[bos], [-100]])], dim=1)
    targets[1, len(second) - 1:] = -100
    alone = [(rows, targets)]
    lengths = token_byte_lengths(load_tokenizer(REPO_ROOT / "model"), 6400)
    kinds = []
    real = document_mask.document_causal_mask
    monkeypatch.setattr("trainer.step.document_causal_mask", lambda s, flex=None: kinds.append(flex) or real(s, flex))
    parts = TrainParts(model, model, None, None, nullcontext(), torch.device("cpu"), 1, doc_mask=trains_with_doc_mask,
                       bos_id=bos)
    (loss, bpb), _ = validate(parts, packed, None, "cpu", 0, 1, lengths, False)
    want_loss, want_bpb = evaluate(model, alone, nullcontext(), "cpu", lengths)
    assert loss == pytest.approx(want_loss, rel=1e-5) and bpb == pytest.approx(want_bpb, rel=1e-5)
    plain_loss, _ = evaluate(model, packed, nullcontext(), "cpu", lengths)
    assert abs(plain_loss - loss) > 1e-4
    assert kinds == [None if trains_with_doc_mask else False]


def test_ppl_max_docs_counts_conversations_too(tmp_path):
    """eval_llm.py --ppl_max_docs N on conversations scores the first N, as on documents."""
    from dataset.lm_dataset import load_tokenizer
    from scripts.eval_llm import conversation_loss
    from tests.support.helpers_data import write_conversations

    tok = load_tokenizer(REPO_ROOT / "model")
    chats = write_conversations(tmp_path / "chat.jsonl", n=6)
    first = tmp_path / "first.jsonl"
    first.write_text("".join(Path(chats).read_text().splitlines(keepends=True)[:2]))
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=6400)).eval()
    cut = conversation_loss(model, tok, chats, max_docs=2, max_seq_len=64)
    assert cut[0] == 2 and cut == conversation_loss(model, tok, first, max_seq_len=64)
    assert conversation_loss(model, tok, chats, max_seq_len=64)[0] > 2  # all of them (one may be cut to nothing)
