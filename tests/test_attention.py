"""The attention fast paths: SDPA's grouped-query attention without K/V copies, and the
packed path's document mask as a FlexAttention BlockMask, each against the plain math."""
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from dataset.packed_dataset import dense_document_mask, document_block_mask, document_causal_mask
from model import model_minimind
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

VOCAB, BOS = 6400, 1


def tiny_model(flash_attn=True, seed=0, **overrides):
    torch.manual_seed(seed)
    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  flash_attn=flash_attn)
    kwargs.update(overrides)
    return MiniMindForCausalLM(MiniMindConfig(**kwargs))


def twin_models(**overrides):
    """The same weights behind SDPA (flash_attn=True) and behind the repeat_interleave math."""
    sdpa, math = tiny_model(True, **overrides), tiny_model(False, **overrides)
    math.load_state_dict(sdpa.state_dict())
    return sdpa, math


def packed_ids(batch=2, length=200, seed=1):
    """Random tokens with a few BOS, so every window holds several documents (and a tail)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    starts = torch.randint(1, length, (batch, 4), generator=gen)
    ids.scatter_(1, starts, BOS)
    return ids


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(ids, shift_labels=torch.roll(ids, -1, dims=1), **kwargs)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same_grads(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


# -----------------------------------------------------------------------------
# grouped-query attention through SDPA

def test_sdpa_gqa_makes_no_copies_of_keys_and_values(monkeypatch):
    sdpa, math = twin_models()

    def no_copies(*args, **kwargs):
        raise AssertionError("repeat_interleave called on the SDPA path")

    ids = packed_ids(length=24)
    expected = math(ids).logits.detach()
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_copies)
    with torch.no_grad():
        causal = sdpa(ids).logits
        masked = sdpa(ids, attention_mask=dense_document_mask(ids, BOS)).logits  # CPU: masked GQA too
    torch.testing.assert_close(causal, expected, atol=1e-5, rtol=1e-5)
    assert causal.shape == masked.shape
    with pytest.raises(AssertionError, match="repeat_interleave"):
        math(ids)  # the check itself can fail


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_sdpa_gqa_equals_repeat_interleave_math_forward_and_gradients(kv_heads):
    sdpa, math = twin_models(num_key_value_heads=kv_heads)
    ids = packed_ids(length=40)
    for mask in (None, dense_document_mask(ids, BOS)):
        logits_a, grads_a = loss_and_grads(sdpa, ids, attention_mask=mask)
        logits_b, grads_b = loss_and_grads(math, ids, attention_mask=mask)
        torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=1e-5)
        assert_same_grads(grads_a, grads_b, atol=1e-5)


@torch.no_grad()
def test_sdpa_gqa_kv_cache_decoding_equals_math():
    sdpa, math = twin_models()
    sdpa.eval(), math.eval()
    ids = packed_ids(length=10)
    past_a = sdpa(ids[:, :4], use_cache=True).past_key_values
    past_b = math(ids[:, :4], use_cache=True).past_key_values
    for t in range(4, 10):
        out_a = sdpa(ids[:, t:t + 1], past_key_values=past_a, use_cache=True)
        out_b = math(ids[:, t:t + 1], past_key_values=past_b, use_cache=True)
        torch.testing.assert_close(out_a.logits, out_b.logits, atol=1e-5, rtol=1e-5)
        past_a, past_b = out_a.past_key_values, out_b.past_key_values
    assert past_a[0][0].shape == (2, 2, 10, 16)  # the cache keeps only the 2 KV heads


# -----------------------------------------------------------------------------
# the document mask as a FlexAttention BlockMask

def test_block_mask_is_exactly_the_dense_document_mask():
    ids = packed_ids(batch=3, length=300)  # not a multiple of FlexAttention's 128-wide blocks
    block = document_block_mask(ids, BOS)
    assert isinstance(block, BlockMask)
    as_dense = create_mask(block.mask_mod, 3, 1, 300, 300, device="cpu")
    assert torch.equal(as_dense, dense_document_mask(ids, BOS))


def test_document_causal_mask_is_dense_on_cpu_unless_asked():
    ids = packed_ids(length=16)
    assert isinstance(document_causal_mask(ids, BOS), torch.Tensor)
    assert isinstance(document_causal_mask(ids, BOS, flex=True), BlockMask)


@torch.no_grad()
def test_flex_attention_equals_dense_mask_forward(monkeypatch):
    """FlexAttention against SDPA with the dense mask. Eager flex_attention here: compiling it
    costs ~30 s of a CPU test (scripts/bench_attention.py compares the compiled kernel).
    FlexAttention has no backward on CPU (torch raises NotImplementedError), so gradients are
    compared on CUDA by scripts/bench_attention.py (run by scripts/gpu_check.sh)."""
    monkeypatch.setattr(model_minimind, "_COMPILED_FLEX", flex_attention)
    model = tiny_model().eval()
    ids = packed_ids(length=200)
    dense = model(ids, attention_mask=dense_document_mask(ids, BOS)).logits
    flex = model(ids, attention_mask=document_block_mask(ids, BOS)).logits
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    plain_causal = model(ids).logits
    assert not torch.allclose(plain_causal, dense, atol=1e-3)  # the documents did matter


def test_block_mask_on_the_math_path_gives_dense_mask_gradients():
    """flash_attn=False (and dropout) turn a BlockMask back into its dense mask."""
    _, math = twin_models()
    ids = packed_ids(length=64)
    logits_a, grads_a = loss_and_grads(math, ids, attention_mask=document_block_mask(ids, BOS))
    logits_b, grads_b = loss_and_grads(math, ids, attention_mask=dense_document_mask(ids, BOS))
    torch.testing.assert_close(logits_a, logits_b, atol=0, rtol=0)
    assert_same_grads(grads_a, grads_b, atol=0)
