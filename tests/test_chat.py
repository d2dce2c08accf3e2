"""Conversations for fine-tuning (dataset/chat.py, dataset/sft_dataset.py): the text they render
to, the tokens the loss covers, the lines that are refused, how a long one is cut, and the
two data paths (padded JSONL, packed .bin) giving the same samples."""
import json

import pytest
import torch

from common.errors import DataError
from dataset.chat import GENERATION_PROMPT, encode, generation_prompt, parse_conversation, render
from dataset.lm_dataset import load_tokenizer
from torch.utils.data import default_collate

from dataset.sft_dataset import (
    ChatOptions, PackedSFTDataset, SFTDataset, conversation_cuts, pack_windows, sample_of,
)
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support import REPO_ROOT
from trainer.step import attention_mask
from scripts.prepare_data import prepare_sft
from tests.support.helpers_data import write_conversations

TOOL_SPEC = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
HAND_WRITTEN = {"conversations": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does `len` do?"},
    {"role": "assistant", "content": "Return the number of items.", "reasoning_content": "\nA builtin.\n"},
    {"role": "user", "content": "And `abs`?"},
    {"role": "assistant", "content": "Return the absolute value."},
]}
# Every field MiniMind's SFT reads: tools, tool calls (a JSON string and a list, with and without
# "function"), consecutive tool results, inline reasoning, a later system turn.
CONVERSATIONS = [
    HAND_WRITTEN,
    {"conversations": [
        {"role": "system", "content": "# Tools", "tools": json.dumps([TOOL_SPEC], ensure_ascii=False)},
        {"role": "user", "content": "Look up 你好."},
        {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "lookup", "arguments": {"q": "你好"}}])},
        {"role": "tool", "content": '{"hit": 1}'},
        {"role": "tool", "content": '{"hit": 2}'},
        {"role": "assistant", "content": "Two hits."}]},
    {"conversations": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nsteps\n</think>\n\nA", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"a": 1}'}}, {"name": "g", "arguments": {"b": [1, 2]}}]},
        {"role": "system", "content": "later"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "\n\nA2"}]},
    {"conversations": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO_ROOT / "model")


def turns_of(conversation) -> list[dict]:
    return parse_conversation(json.dumps(conversation).encode(), "x.jsonl:1")


def text_of(conversation, **kwargs) -> str:
    return "".join(block.text for block in render(turns_of(conversation), **kwargs))


def test_rendering_of_a_conversation_with_system_prompt_and_reasoning():
    assert text_of(HAND_WRITTEN) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat does `len` do?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nA builtin.\n</think>\n\nReturn the number of items.<|im_end|>\n"
        "<|im_start|>user\nAnd `abs`?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nReturn the absolute value.<|im_end|>\n")
    assert text_of(HAND_WRITTEN, keep_empty_think=False).endswith(
        "<|im_start|>assistant\nReturn the absolute value.<|im_end|>\n")


@pytest.mark.parametrize("number", range(len(CONVERSATIONS)))
def test_our_rendering_is_what_the_chat_template_renders(tokenizer, number):
    """The text training sees is the text stock transformers makes of the same messages (the
    tools passed as MiniMind's SFTDataset passes them), and so is the prompt to answer."""
    turns = turns_of(CONVERSATIONS[number])
    tools = [t["tools"] for t in turns if "tools" in t] or [None]
    assert tokenizer.apply_chat_template(turns, tools=tools[-1], tokenize=False) == text_of(CONVERSATIONS[number])
    assert tokenizer.apply_chat_template(turns, tools=tools[-1], tokenize=False, add_generation_prompt=True) \
        == generation_prompt(turns)
    assert generation_prompt(turns).endswith(GENERATION_PROMPT)


def test_the_tool_blocks_render_as_minimind_s_template_writes_them():
    text = text_of(CONVERSATIONS[1])
    assert text.startswith("<|im_start|>system\n# Tools\n\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}\n</tools>' \
        in text
    assert ('<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"q": "你好"}}\n'
            '</tool_call><|im_end|>\n') in text
    assert ('<|im_start|>user\n<tool_response>\n{"hit": 1}\n</tool_response>\n<tool_response>\n{"hit": 2}\n'
            '</tool_response><|im_end|>\n') in text


def test_the_loss_mask_token_by_token(tokenizer):
    """Each token of the hand-written conversation, in order, with whether the loss looks at
    it: exactly each reply after its header, through its <|im_end|> (not the newline after)."""
    encoded = encode(tokenizer, render(turns_of(HAND_WRITTEN)))
    pieces = [tokenizer.decode([i]) for i in encoded.ids]
    runs = []  # consecutive tokens with the same flag, joined
    for piece, trained in zip(pieces, encoded.trained):
        if runs and runs[-1][1] == trained:
            runs[-1][0] += piece
        else:
            runs.append([piece, trained])
    assert runs == [
        ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does `len` do?<|im_end|>\n"
         "<|im_start|>assistant\n", False],
        ["<think>\nA builtin.\n</think>\n\nReturn the number of items.<|im_end|>", True],
        ["\n<|im_start|>user\nAnd `abs`?<|im_end|>\n<|im_start|>assistant\n", False],
        ["<think>\n\n</think>\n\nReturn the absolute value.<|im_end|>", True],
        ["\n", False],
    ]
    assert encoded.ids == tokenizer(text_of(HAND_WRITTEN), add_special_tokens=False).input_ids
    # The sample's targets: token t + 1 where the loss looks at it, else -100.
    ids, targets, starts = sample_of(encoded, 128, tokenizer.pad_token_id)
    n = len(encoded.ids)
    assert targets[:n - 1].tolist() == [i if t else -100 for i, t in zip(encoded.ids[1:], encoded.trained[1:])]
    assert (targets[n - 1:] == -100).all() and (ids[n:] == tokenizer.pad_token_id).all()
    assert starts.nonzero().flatten().tolist() == [0, n]  # one document, then the padding


def test_a_cut_keeps_complete_turns_and_gives_up_without_a_reply(tokenizer):
    encoded = encode(tokenizer, render(turns_of(HAND_WRITTEN)))
    ends = encoded.block_ends  # system, user, assistant, user, assistant
    assert len(ends) == 5 and ends[-1] == len(encoded.ids)
    assert encoded.cut(len(encoded.ids)) == encoded
    cut = encoded.cut(ends[4] - 1)  # the last reply does not fit: the first three turns and the question stay
    assert cut.ids == encoded.ids[:ends[3]] and cut.block_ends == ends[:4]
    assert encoded.cut(ends[2] - 1) is None  # no complete reply fits: nothing to train on


BAD_LINES = [
    ('{"text": "a pre-training line"}', 'no "conversations" list of turns (keys: "text")'),
    ('{"conversations": []}', 'no "conversations" list'),
    ('{"conversations": [{"content": "hi"}]}', 'turn 1: no "role"'),
    ('{"conversations": [{"role": "bot", "content": "hi"}]}', "turn 1: role 'bot'"),
    ('{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant"}]}', 'turn 2: no "content"'),
    ('{"conversations": [{"role": "user", "content": null}]}', 'turn 1: "content" is a JSON NoneType'),
    ('{"conversations": [{"role": "assistant", "content": "", "tool_calls": "[{"}]}',
     "turn 1: 'tool_calls' is not valid JSON"),
    ('not json', "not valid JSON"),
]


@pytest.mark.parametrize("line, says", BAD_LINES)
def test_a_bad_line_is_one_error_naming_its_line(tokenizer, tmp_path, line, says):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(HAND_WRITTEN) + "\n" + line + "\n")
    for read in (lambda: SFTDataset(path, tokenizer, 64), lambda: prepare_sft(path, tmp_path / "sft.bin", num_proc=1)):
        with pytest.raises(DataError) as exc:
            read()
        assert str(exc.value).startswith(f"{path}:2: ") and says in str(exc.value), str(exc.value)
        assert "\n" not in str(exc.value)
    assert not (tmp_path / "sft.bin").exists()


def test_a_file_without_any_reply_is_refused(tokenizer, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "user", "content": "hello?"}]}) + "\n")
    for read in (lambda: SFTDataset(path, tokenizer, 64), lambda: prepare_sft(path, tmp_path / "sft.bin", num_proc=1)):
        with pytest.raises(DataError, match="no assistant turn in any"):
            read()


# ---------------------------------------------------------------------------- the two paths
def first_reply_end(tokenizer, conversation) -> int:
    """The token count through the end of the conversation's first assistant block."""
    blocks = render(turns_of(conversation))
    first = next(i for i, block in enumerate(blocks) if block.trained)
    return encode(tokenizer, blocks).block_ends[first]


def pairs_by_conversation(samples) -> list[list[tuple[int, int]]]:
    """The (token, target) pairs the loss sees, per conversation, in order."""
    out = []
    for sample in samples:
        ids, targets = sample[0], sample[1]
        starts = sample[2].nonzero().flatten().tolist() if len(sample) > 2 else [0]
        for a, b in zip(starts, starts[1:] + [len(ids)]):
            pairs = [(int(x), int(y)) for x, y in zip(ids[a:b], targets[a:b]) if y != -100]
            out += [pairs] if pairs else []
    return out


def test_packed_and_padded_train_on_the_same_pairs_with_less_padding(tokenizer, tmp_path):
    jsonl = write_conversations(tmp_path / "c.jsonl")
    stats = prepare_sft(jsonl, tmp_path / "c.bin", num_proc=1)
    assert stats["conversations"] == 40
    for length in (48, 96, 512):
        padded = SFTDataset(jsonl, tokenizer, length)
        packed = PackedSFTDataset(tmp_path / "c.bin", length, 6400, tokenizer, tokenizer.pad_token_id)
        # A conversation is skipped where its first reply does not end within the length.
        ends = [first_reply_end(tokenizer, json.loads(line)) for line in jsonl.read_text().splitlines()]
        assert padded.skipped == packed.skipped == sum(end > length for end in ends)
        assert (padded.skipped > 0) == (length == 48)
        assert pairs_by_conversation(padded[i] for i in range(len(padded))) == \
            pairs_by_conversation(packed[i] for i in range(len(packed)))
        if length == 512:
            assert len(packed) < len(padded) / 4
            real = sum(int((packed[i][0] != tokenizer.pad_token_id).sum()) for i in range(len(packed)))
            assert real / (len(packed) * length) > 0.8


def test_a_packed_window_marks_where_its_conversations_start(tokenizer, tmp_path):
    prepare_sft(write_conversations(tmp_path / "c.jsonl", n=6), tmp_path / "c.bin", num_proc=1)
    packed = PackedSFTDataset(tmp_path / "c.bin", 512, 6400, tokenizer, tokenizer.pad_token_id)
    assert len(packed) == 1
    ids, targets, starts = packed[0]
    where = starts.nonzero().flatten().tolist()
    assert len(where) == 7  # six conversations, then the padding
    assert all(ids[i] == tokenizer.bos_token_id for i in where[:-1])
    assert (ids[where[-1]:] == tokenizer.pad_token_id).all() and (targets[where[-1] - 1:] == -100).all()


def test_a_padded_conversation_is_validated_as_one_document(tokenizer, tmp_path):
    # Every turn opens with BOS (<|im_start|>). Validation draws the document mask wherever a
    # sample does not mark its documents, so a padded conversation must mark itself as one, or
    # each answer is scored without its question.
    padded = SFTDataset(write_conversations(tmp_path / "c.jsonl", n=6), tokenizer, 256)
    batch = default_collate([padded[i] for i in range(len(padded))])
    assert ((batch[0] == tokenizer.bos_token_id).sum(1) >= 2).all()  # a user and an assistant turn at least
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2)).eval()
    with torch.no_grad():
        masked = model(batch[0], attention_mask=attention_mask(batch, True, tokenizer.bos_token_id, flex=False),
                       shift_labels=batch[1]).loss
        causal = model(batch[0], shift_labels=batch[1]).loss
    assert torch.allclose(masked, causal, atol=1e-5), (masked, causal)


def test_cuts_and_windows_by_hand():
    # blocks: (first token, conversation, loss start, loss end); conversation 0 is 10 tokens in
    # blocks 0-4, 4-10 (trained 6-10); conversation 1 is 12 tokens, blocks 10-14, 14-22 (trained 16-22).
    blocks = torch.tensor([[0, 0, 0, 0], [4, 0, 6, 10], [10, 1, 10, 10], [14, 1, 16, 22]]).numpy()
    starts, cuts = conversation_cuts(blocks, 2, 22, max_length=11)
    assert starts.tolist() == [0, 10] and cuts.tolist() == [10, 10]  # conversation 1 keeps no reply in 11
    starts, cuts = conversation_cuts(blocks, 2, 22, max_length=12)
    assert cuts.tolist() == [10, 22]
    assert pack_windows(torch.tensor([10, 12, 3, 5, 9]).numpy(), 15).tolist() == [[0, 1], [1, 3], [3, 5]]


def test_augmentation_is_drawn_per_sample_and_again_the_same(tokenizer, tmp_path):
    jsonl = write_conversations(tmp_path / "c.jsonl")
    plain = SFTDataset(jsonl, tokenizer, 128)
    options = ChatOptions(add_system_ratio=0.5, empty_think_ratio=0.5, seed=3)
    first, again = SFTDataset(jsonl, tokenizer, 128, options), SFTDataset(jsonl, tokenizer, 128, options)
    changed = 0
    for i in range(len(plain)):
        assert torch.equal(first[i][0], again[i][0])  # a resume, a worker, another rank: the same draw
        changed += not torch.equal(first[i][0], plain[i][0])
    assert 10 < changed < len(plain)


def test_a_global_batch_without_a_reply_has_a_zero_loss_not_nan():
    """Every target -100 (a window of conversations whose replies were all cut): no 0 / 0. The
    step is taken, with a zero loss and zero gradients, and nothing turns NaN."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from contextlib import nullcontext

    from trainer.step import TrainParts, optimizer_step

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ids = torch.randint(3, 512, (2, 16))
    starts = torch.zeros(2, 16, dtype=torch.bool)
    starts[:, 0] = True
    context = TrainParts(model, model, optimizer, scaler, nullcontext(), torch.device("cpu"), 1, doc_mask=True,
                         bos_id=1)
    before = [p.detach().clone() for p in model.parameters()]
    result = optimizer_step(context, [(ids, torch.full_like(ids, -100), starts)])
    assert not result.skipped
    figures = {name: figure.item() for name, figure in result.figures.items()}
    assert figures.pop("finite_norms") == 1  # the zero gradient's norm, 0, is finite
    assert "loss" in figures and all(value == 0 for value in figures.values()), figures
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # SGD on zero gradients
