"""The attention fast paths: SDPA's grouped-query attention without K/V copies, and the
packed path's document mask as a FlexAttention BlockMask, each against the plain math."""
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from model.document_mask import dense_document_mask, document_block_mask, document_causal_mask, document_ids
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
        masked = sdpa(ids, attention_mask=dense_document_mask(ids == BOS)).logits  # CPU: masked GQA too
    torch.testing.assert_close(causal, expected, atol=1e-5, rtol=1e-5)
    assert causal.shape == masked.shape
    with pytest.raises(AssertionError, match="repeat_interleave"):
        math(ids)  # the check itself can fail


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_sdpa_gqa_equals_repeat_interleave_math_forward_and_gradients(kv_heads):
    sdpa, math = twin_models(num_key_value_heads=kv_heads)
    ids = packed_ids(length=40)
    for mask in (None, dense_document_mask(ids == BOS)):
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

def test_document_causal_mask():
    bos = BOS
    input_ids = torch.tensor([[5, 1, 7, 8, 1, 9],    # tail of a doc, then two docs
                              [4, 4, 4, 4, 4, 4]])   # no BOS: one doc, plain causal
    mask = document_causal_mask(input_ids == bos)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())


def test_block_mask_is_exactly_the_dense_document_mask():
    ids = packed_ids(batch=3, length=300)  # not a multiple of FlexAttention's 128-wide blocks
    block = document_block_mask(ids == BOS)
    assert isinstance(block, BlockMask)
    as_dense = create_mask(block.mask_mod, 3, 1, 300, 300, device="cpu")
    assert torch.equal(as_dense, dense_document_mask(ids == BOS))


def _layouts():
    """Windows of BOS layouts the block boundaries must get right, by name."""
    gen = torch.Generator().manual_seed(3)
    layouts = {}
    for length in (128, 256, 300, 1024):
        plain = torch.randint(3, 500, (2, length), generator=gen)
        layouts[f"one document, {length}"] = plain
        spanning = plain.clone()
        spanning[:, [0, 100, 400 % length, 700 % length]] = BOS  # documents that cross blocks
        layouts[f"documents across blocks, {length}"] = spanning
        tiny = plain.clone()
        tiny[:, 60:70] = BOS  # ten one-token documents in a row
        tiny[:, length - 1] = BOS  # a document that starts at the very last position
        layouts[f"one-token documents, {length}"] = tiny
        tail = plain.clone()
        tail[:, length // 3] = BOS  # the window starts inside a document and ends inside another
        layouts[f"ends mid-document, {length}"] = tail
        for seed in range(3):
            noisy = plain.clone()
            noisy.scatter_(1, torch.randint(0, length, (2, 1 + 4 * seed), generator=gen), BOS)
            layouts[f"random {seed}, {length}"] = noisy
    return layouts


@pytest.mark.parametrize("name", list(_layouts()))
def test_block_mask_from_document_boundaries_equals_create_block_mask(name):
    """The BlockMask built from each block's first and last document equals the one
    create_block_mask finds by evaluating the mask at every position: the same blocks
    computed, and the same ones computed without the mask function (full blocks)."""
    ids = _layouts()[name]
    doc_ids = document_ids(ids == BOS)
    T = ids.shape[1]
    reference = create_block_mask(lambda b, h, q, kv: (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv]),
                                  ids.shape[0], None, T, T, device="cpu")
    ours = document_block_mask(ids == BOS)
    assert torch.equal(ours.to_dense(), reference.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, reference.full_kv_num_blocks)
    assert torch.equal(create_mask(ours.mask_mod, ids.shape[0], 1, T, T, device="cpu"), dense_document_mask(ids == BOS))


def test_building_the_block_mask_reads_nothing_back_to_the_host():
    from tests.support.host_reads import CountHostReads

    ids = _layouts()["documents across blocks, 1024"]
    with CountHostReads() as counter:
        document_block_mask(ids == BOS)
    assert counter.reads == 0


def test_document_causal_mask_is_dense_on_cpu_unless_asked():
    ids = packed_ids(length=16)
    assert isinstance(document_causal_mask(ids == BOS), torch.Tensor)
    assert isinstance(document_causal_mask(ids == BOS, flex=True), BlockMask)


def test_flex_attention_only_on_gpus_whose_shared_memory_holds_its_kernels(monkeypatch):
    """A100, H100/H200 and B200 take FlexAttention; consumer GPUs (99 KiB of shared memory per
    block), sm 7.5 and the CPU take the dense mask, which SDPA runs everywhere."""
    from model.document_mask import flex_fits

    gpu = torch.device("cuda", 0)
    for capability, fits in [((8, 0), True), ((9, 0), True), ((10, 0), True), ((7, 5), False), ((8, 6), False),
                             ((8, 9), False), ((12, 0), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert flex_fits(gpu) is fits, capability
    assert flex_fits(torch.device("cpu")) is False


@torch.no_grad()
def test_flex_attention_equals_dense_mask_forward(monkeypatch):
    """FlexAttention against SDPA with the dense mask. Eager flex_attention here: compiling it
    costs ~30 s of a CPU test (scripts/bench/bench_ops.py attention compares the compiled kernel).
    FlexAttention has no backward on CPU (torch raises NotImplementedError), so gradients are
    compared on CUDA by scripts/bench/bench_ops.py attention (run by scripts/bench/gpu_check.sh)."""
    monkeypatch.setattr(model_minimind, "_COMPILED_FLEX", flex_attention)
    model = tiny_model().eval()
    ids = packed_ids(length=200)
    dense = model(ids, attention_mask=dense_document_mask(ids == BOS)).logits
    flex = model(ids, attention_mask=document_block_mask(ids == BOS)).logits
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    plain_causal = model(ids).logits
    assert not torch.allclose(plain_causal, dense, atol=1e-3)  # the documents did matter


def test_block_mask_on_the_math_path_gives_dense_mask_gradients():
    """flash_attn=False (and dropout) turn a BlockMask back into its dense mask."""
    _, math = twin_models()
    ids = packed_ids(length=64)
    logits_a, grads_a = loss_and_grads(math, ids, attention_mask=document_block_mask(ids == BOS))
    logits_b, grads_b = loss_and_grads(math, ids, attention_mask=dense_document_mask(ids == BOS))
    torch.testing.assert_close(logits_a, logits_b, atol=0, rtol=0)
    assert_same_grads(grads_a, grads_b, atol=0)
