"""PretrainDataset: sample layout, truncation, blank lines, lazy reading, and every bad-input message."""

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from common.errors import DataError
from dataset.lm_dataset import PretrainDataset, iter_jsonl_texts
from tests.support import helpers_data


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_layout_bos_eos_pad_labels(tmp_path, tokenizer):
    texts = ["hello world", "a"]
    path = helpers_data.write_jsonl(tmp_path / "data.jsonl", texts)
    ds = PretrainDataset(path, tokenizer, max_length=32)
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert (bos, eos, pad) == (1, 2, 0)
    assert len(ds) == 2
    for i, text in enumerate(texts):
        input_ids, labels = ds[i]
        assert input_ids.shape == labels.shape == (32,)
        assert input_ids.dtype == labels.dtype == torch.int64
        real = [bos] + encode(tokenizer, text) + [eos]
        n = len(real)
        assert input_ids.tolist() == real + [pad] * (32 - n)
        # labels are the ids themselves (the model shifts), with padding ignored
        assert labels.tolist() == real + [-100] * (32 - n)


def test_the_trainer_reads_next_token_targets(tmp_path, tokenizer):
    from dataset.lm_dataset import NextTokenTargets

    path = helpers_data.write_jsonl(tmp_path / "data.jsonl", ["hello world"])
    padded = PretrainDataset(path, tokenizer, max_length=16)
    input_ids, targets = NextTokenTargets(padded)[0]
    _, labels = padded[0]
    assert torch.equal(input_ids, padded[0][0])
    assert targets.tolist() == labels[1:].tolist() + [-100]  # the token after each position
    assert len(NextTokenTargets(padded)) == len(padded)


def test_truncation_keeps_bos_and_eos(tmp_path, tokenizer):
    text = " ".join(helpers_data.SAMPLE_TEXTS)
    ids = encode(tokenizer, text)
    max_length = 10
    assert len(ids) > max_length
    path = helpers_data.write_jsonl(tmp_path / "data.jsonl", [text])
    input_ids, labels = PretrainDataset(path, tokenizer, max_length)[0]
    expected = [tokenizer.bos_token_id] + ids[:max_length - 2] + [tokenizer.eos_token_id]
    assert input_ids.tolist() == expected
    assert labels.tolist() == expected  # nothing padded, nothing ignored


def test_blank_lines_skipped_but_counted(tmp_path, tokenizer):
    path = helpers_data.write_jsonl(tmp_path / "data.jsonl", [None, "one", None, "two", None])
    with open(path, "a") as f:
        f.write("   \t \r\n")
    ds = PretrainDataset(path, tokenizer, max_length=16)
    assert len(ds) == 2
    assert ds.line_numbers.tolist() == [2, 4]
    assert [text for _, text in iter_jsonl_texts(path)] == ["one", "two"]
    # a bad line after the blanks is reported with its real line number
    with open(path, "a") as f:
        f.write("oops\n")
    with pytest.raises(DataError, match=r"data\.jsonl:7: not valid JSON"):
        PretrainDataset(path, tokenizer, max_length=16)


def test_utf8_bom_on_first_line_is_accepted(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n')
    assert list(iter_jsonl_texts(path)) == [(1, "hi")]


# (file name, raw content or None for "don't create", line number or None, words the message must contain)
BAD_INPUTS = {
    "missing": ("nope.jsonl", None, None, ["not found", "--data_path"]),
    "empty": ("empty.jsonl", b"", None, ["empty"]),
    "only_blank": ("blank.jsonl", b"\n  \n\t\n", None, ["only blank lines"]),
    "not_utf8": ("latin.jsonl", b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', 3, ["not valid UTF-8", "0xe9"]),
    "not_json": ("data.jsonl", b'{"text": "ok"}\n{"text": "a" "b"}\n', 2,
                 ["not valid JSON (Expecting ',' delimiter)", '{"text": "..."}']),
    "not_object": ("list.jsonl", b'["just", "a", "list"]\n', 1, ["expected a JSON object", "array"]),
    "no_text": ("keys.jsonl", b'{"text": "ok"}\n{"content": "x", "id": 3}\n', 2,
                ['no "text" field', '"content", "id"']),
    "text_not_string": ("num.jsonl", b'{"text": 42}\n', 1, ['"text" must be a string', "number"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_messages(case, tmp_path, tokenizer):
    name, content, line, words = BAD_INPUTS[case]
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as info:
        PretrainDataset(path, tokenizer, max_length=16)
    message = str(info.value)
    assert "\n" not in message
    assert name in message
    if line is not None:
        assert f"{name}:{line}: " in message
    for w in words:
        assert w in message
    # the streaming reader used by prepare_data.py says exactly the same
    with pytest.raises(DataError) as info2:
        list(iter_jsonl_texts(path))
    assert str(info2.value) == message


def test_directory_is_rejected(tmp_path, tokenizer):
    folder = tmp_path / "corpus_dir"
    folder.mkdir()
    with pytest.raises(DataError, match=r"corpus_dir: is a directory"):
        PretrainDataset(folder, tokenizer, max_length=16)


def test_lazy_reading_through_dataloader_workers(tmp_path, tokenizer):
    texts = [f"document number {i} " + helpers_data.SAMPLE_TEXTS[i % 5] for i in range(23)]
    path = helpers_data.write_jsonl(tmp_path / "data.jsonl", texts)
    ds = PretrainDataset(path, tokenizer, max_length=24)
    assert ds._file is None  # the indexing scan doesn't leave a handle behind to be forked
    expected = torch.stack([ds[i][0] for i in range(len(ds))])
    loader = DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    got = torch.cat([input_ids for input_ids, _ in loader])
    assert torch.equal(got, expected)
    # the open handle of this process is not pickled (spawn-started workers reopen their own)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._file is None and torch.equal(clone[5][0], expected[5])
