"""Bits per byte: a loss that does not depend on the tokenizer.

    bits per byte = (summed NLL of the scored targets, in bits) / (UTF-8 bytes those targets spell)

What counts: every target the loss scores counts its NLL, the special ones included
(EOS: where a document ends is information the model must spend bits on; in packed
data also the BOS that follows an EOS, which costs next to nothing). Special tokens
spell no text, so they add 0 bytes. Over a document framed BOS + text + EOS, the bytes
are then exactly the UTF-8 bytes of the text, and the figure compares across
tokenizers. The trainer's validation and `scripts/eval_llm.py --ppl_data` apply the
same rule.
"""
import math

import torch

from common.labels import IGNORE_INDEX


def _byte_alphabet() -> dict:
    """Byte-level BPE writes each byte as one printable character: bytes that print as
    themselves keep their code point; the others (control characters, space, ...) move
    to 256 and up, in byte order. This is the inverse map, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each token id decodes to (0 for special tokens and unused ids), as int64[vocab_size]."""
    alphabet = _byte_alphabet()
    special = set(tokenizer.all_special_ids) | {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    lengths = torch.zeros(vocab_size, dtype=torch.int64)
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size or index in special:
            continue
        if any(ch not in alphabet for ch in token):
            raise ValueError(f"token {token!r} (id {index}) is not byte-level BPE; bits per byte needs a "
                             f"byte-level tokenizer")
        lengths[index] = len(token)  # one character per byte
    return lengths


def target_bytes(targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Bytes spelled by the scored targets (-100 is not scored)."""
    scored = targets != IGNORE_INDEX
    return (lengths.to(targets.device)[targets.clamp(min=0)] * scored).sum()


def bits_per_byte(nll_nats: float, n_bytes: float) -> float:
    return nll_nats / math.log(2) / max(n_bytes, 1)
