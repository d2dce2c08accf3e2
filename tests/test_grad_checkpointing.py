"""--grad_checkpointing recomputes each block in backward; it must not change the math."""
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM


def _grads(use_moe, checkpointing):
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, use_moe=use_moe)).train()
    model.model.gradient_checkpointing = checkpointing
    ids = torch.randint(3, 6400, (2, 48), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_match_with_and_without_checkpointing():
    for use_moe in (False, True):
        loss_plain, plain = _grads(use_moe, False)
        loss_ckpt, ckpt = _grads(use_moe, True)
        assert loss_plain == loss_ckpt
        assert plain.keys() == ckpt.keys()
        for name in plain:
            assert torch.allclose(plain[name], ckpt[name], atol=1e-6, rtol=0), name


def test_checkpointing_actually_recomputes():
    """Count block forwards: with checkpointing each block runs again during backward."""
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2)).train()
    calls = []
    for layer in model.model.layers:  # wrap forward itself: module hooks are off during recomputation
        layer.forward = _counting(layer.forward, calls)
    ids = torch.randint(3, 6400, (1, 16))
    model.model.gradient_checkpointing = True
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 4  # 2 forwards + 2 recomputations


def _counting(forward, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return counted
