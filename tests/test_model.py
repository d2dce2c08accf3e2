"""Behaviour of model/model_minimind.py on tiny configs (hidden 64, 2 layers, 4 heads, 2 kv heads)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from model.generation import pick_next_token
from model.model_minimind import (
    MiniMindConfig, MiniMindForCausalLM, causal_lm_loss, count_parameters, register_auto_classes,
)

VOCAB = 6400


def tiny_config(**overrides):
    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    kwargs.update(overrides)
    return MiniMindConfig(**kwargs)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(tiny_config(**overrides)).eval()


def random_ids(batch=2, length=12, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def same_weights(model, **overrides):
    """A model with `model`'s weights but a changed config (e.g. the other attention path)."""
    other = MiniMindForCausalLM(tiny_config(**{**model.config.to_diff_dict(), **overrides})).eval()
    other.load_state_dict(model.state_dict())
    return other


MODELS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "moe": {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.fixture(params=list(MODELS))
def model(request):
    return tiny_model(**MODELS[request.param])


# -----------------------------------------------------------------------------
# forward pass

@torch.no_grad()
def test_shapes(model):
    ids = random_ids()
    out = model(ids, labels=ids, use_cache=True)
    assert out.logits.shape == (2, 12, VOCAB)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert len(out.past_key_values) == 2
    k, v = out.past_key_values[0]
    assert k.shape == v.shape == (2, model.config.num_key_value_heads, 12, 16)
    assert model(ids, logits_to_keep=1).logits.shape == (2, 1, VOCAB)


@torch.no_grad()
def test_causality(model):
    ids = random_ids()
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@torch.no_grad()
def test_kv_cache_decoding_equals_full_forward(model):
    ids = random_ids(length=10)
    full = model(ids).logits
    out = model(ids[:, :4], use_cache=True)
    steps = [out.logits]
    for t in range(4, 10):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_math_attention_equals_sdpa(model):
    math_model = same_weights(model, flash_attn=False)
    ids = random_ids()
    torch.testing.assert_close(math_model(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch.testing.assert_close(math_model(ids, attention_mask=mask).logits,
                               model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
    past = model(ids[:, :8], use_cache=True).past_key_values
    torch.testing.assert_close(math_model(ids[:, 8:], past_key_values=past).logits,
                               model(ids[:, 8:], past_key_values=past).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flash_attn", [True, False])
@torch.no_grad()
def test_left_padding_matches_unpadded(flash_attn):
    model = tiny_model(flash_attn=flash_attn)
    short, long = random_ids(1, 6, seed=2), random_ids(1, 9, seed=3)
    pad = torch.zeros(1, 3, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, short], dim=1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    logits = model(batch, attention_mask=mask).logits
    assert torch.isfinite(logits).all()  # padded queries must not turn into NaN
    # RoPE is relative, so shifting the real tokens right by the padding changes nothing.
    torch.testing.assert_close(logits[0, -1], model(short).logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, -1], model(long).logits[0, -1], atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# mixture of experts

def test_moe_every_parameter_gets_a_gradient():
    # One token with top-1 routing: three of the four experts in each layer get nothing.
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=1).train()
    ids = random_ids(1, 1)
    out = model(ids, shift_labels=ids)
    (out.loss + out.aux_loss).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    idle = [e for e in model.model.layers[0].mlp.experts if not e.down_proj.weight.grad.any()]
    assert len(idle) == 3  # the idle experts really got no token, yet have a (zero) gradient


def test_moe_aux_loss_summed_over_layers():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2).train()
    out = model(random_ids())
    per_layer = [layer.mlp.aux_loss for layer in model.model.layers]
    assert all(aux > 0 for aux in per_layer)
    torch.testing.assert_close(out.aux_loss, torch.stack(per_layer).sum())
    model.eval()
    assert model(random_ids()).aux_loss == 0


def test_dense_aux_loss_is_zero():
    assert tiny_model().train()(random_ids()).aux_loss == 0


# -----------------------------------------------------------------------------
# loss

def test_loss_ignores_minus_100_and_equals_manual_ce():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 50)
    labels = torch.randint(0, 50, (2, 8))
    labels[0, 5:] = -100
    labels[1, 2] = -100
    loss = causal_lm_loss(logits, labels)
    # Logits whose target is -100 do not matter...
    changed = logits.clone()
    changed[0, 4:7] += 10 * torch.randn(3, 50)  # targets labels[0, 5:8] are all -100
    changed[1, 1] += 10 * torch.randn(50)       # target labels[1, 2] is -100
    torch.testing.assert_close(causal_lm_loss(changed, labels), loss)
    # ...and the rest average like a hand-written cross-entropy over valid targets.
    targets = labels[:, 1:]
    valid = targets != -100
    manual = F.cross_entropy(logits[:, :-1][valid], targets[valid])
    torch.testing.assert_close(loss, manual)


def test_shift_labels_and_num_items_in_batch():
    model = tiny_model()
    ids = random_ids()
    labels = ids.clone()
    labels[1, 9:] = -100
    loss = model(ids, labels=labels).loss
    # shift_labels are the same targets already aligned with the logits.
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(model(ids, shift_labels=shift).loss, loss)
    # num_items_in_batch replaces the count of valid targets: sum / N.
    count = int((shift != -100).sum())
    total = model(ids, shift_labels=shift, num_items_in_batch=1).loss
    torch.testing.assert_close(total, loss * count)
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=4 * count).loss, loss / 4)


# -----------------------------------------------------------------------------
# save / load, parameter counts, generation

@pytest.mark.parametrize("use_moe", [False, True])
@torch.no_grad()
def test_save_and_load_pretrained(tmp_path, use_moe):
    register_auto_classes()
    model = tiny_model(use_moe=use_moe)
    model.save_pretrained(tmp_path)
    ids = random_ids()
    expected = model(ids).logits
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, MiniMindConfig) and config.use_moe == use_moe
    for loaded in (MiniMindForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert type(loaded).__name__ == "MiniMindForCausalLM"
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        torch.testing.assert_close(loaded.eval()(ids).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("hidden, low, high", [(512, 20e6, 35e6), (768, 55e6, 75e6)])
def test_parameter_counts(hidden, low, high):
    with torch.device("meta"):
        dense = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=8))
        moe = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=8, use_moe=True))
    total, active = count_parameters(dense)
    moe_total, moe_active = count_parameters(moe)
    print(f"hidden {hidden}: dense {total / 1e6:.2f}M; "
          f"moe {moe_total / 1e6:.2f}M total, {moe_active / 1e6:.2f}M active")
    assert low < total < high and active == total
    # 4 experts, 1 active: a token pays about what it pays in the dense model.
    assert moe_total > 2.5 * total
    assert abs(moe_active - total) < 0.01 * total


def test_generate_greedy_with_and_without_cache():
    model = tiny_model()
    prompt = random_ids(2, 5)
    cached = model.generate(prompt, max_new_tokens=8, eos_token_id=-1)
    uncached = model.generate(prompt, max_new_tokens=8, eos_token_id=-1, use_cache=False)
    assert cached.shape == (2, 13)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], prompt)


def test_generate_takes_transformers_arguments_as_lm_eval_passes_them():
    model = tiny_model()
    prompt = random_ids(2, 5)
    greedy = model.generate(prompt, max_new_tokens=8, eos_token_id=-1)
    # max_length counts the prompt; max_new_tokens wins where both are given.
    assert torch.equal(model.generate(prompt, max_length=9, eos_token_id=-1), greedy[:, :9])
    assert model.generate(prompt, max_length=9, max_new_tokens=2, eos_token_id=-1).shape == (2, 7)
    # A stopping criterion ends its rows as EOS does: they emit the pad token from then on.
    stop_row_0 = lambda tokens, scores: torch.tensor([tokens.shape[1] >= 7, False])  # noqa: E731
    stopped = model.generate(prompt, max_new_tokens=8, eos_token_id=-1, pad_token_id=99, stopping_criteria=stop_row_0)
    assert torch.equal(stopped[0, :7], greedy[0, :7]) and (stopped[0, 7:] == 99).all()
    assert torch.equal(stopped[1], greedy[1])
    # eos_token_id may be a list, as in Qwen3's configs.
    first = int(greedy[0, 5])
    assert model.generate(prompt[:1], max_new_tokens=8, eos_token_id=[-1, first]).shape == (1, 6)
    with pytest.raises(TypeError, match="num_beams"):
        model.generate(prompt, max_new_tokens=8, num_beams=4)


def test_a_streamer_gets_the_prompt_first_then_each_new_token():
    model = tiny_model()
    prompt = random_ids(1, 5)

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, ids):
            self.puts.append(ids.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Recorder()
    tokens = model.generate(prompt, max_new_tokens=4, eos_token_id=-1, streamer=streamer)
    assert streamer.puts == [prompt[0].tolist()] + [[t] for t in tokens[0, 5:].tolist()] and streamer.ended


def test_top_p_at_zero_keeps_the_best_token():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, -1.0]])
    torch.manual_seed(0)
    assert pick_next_token(logits, True, 1.0, 0, 0.0).tolist() == [1, 0]


def test_sampling_with_top_k_1_is_greedy():
    model = tiny_model(use_moe=True)
    prompt = random_ids(2, 5)
    greedy = model.generate(prompt, max_new_tokens=8, eos_token_id=-1)
    torch.manual_seed(123)
    sampled = model.generate(prompt, max_new_tokens=8, eos_token_id=-1, do_sample=True, temperature=1.5, top_k=1)
    assert torch.equal(sampled, greedy)
