"""--zero_init_outputs: a fresh model's block output projections start at 0
(trainer/trainer_utils.py's zero_output_projections, called from build_parts), and nothing
else changes: not the other weights, not a model loaded with --from_weight."""
import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support.tiny import TINY
from trainer.config import parse_config
from trainer.distributed import DistEnv
from trainer.trainer_utils import initial_weights, model_config, zero_output_projections


@pytest.mark.parametrize("use_moe, expected", [(False, 2 * 2), (True, 2 * (1 + 4))])
def test_every_blocks_output_projections_and_only_they_start_at_zero(use_moe, expected):
    """2 layers: o_proj and down_proj each (4), or o_proj and the 4 experts' down_proj (10). Each
    block then adds 0 to the residual stream: the last hidden state is the embedding's."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512, use_moe=use_moe))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert zero_output_projections(model) == expected
    zeroed = [n for n, p in model.named_parameters() if not p.any()]
    assert len(zeroed) == expected and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in zeroed)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n not in zeroed)
    ids = torch.randint(3, 512, (2, 16))
    hidden = model.model.norm(model.model.embed_tokens(ids))
    torch.testing.assert_close(model(ids).logits, model.lm_head(hidden))


def test_build_parts_zeroes_a_fresh_model_and_leaves_loaded_weights_be(tmp_path):
    from trainer.loop import build_parts

    def parts(*flags):
        cfg = parse_config([*TINY, *flags])[0].replace(optimizer="muon", muon_lr=0.01, normuon=1, lr_schedule="wsd",
                                                            weight_decay=0.5, adam_betas=(0.9, 0.999))
        return build_parts(cfg, DistEnv(), model_config(cfg), initial_weights(cfg), bos_id=1, packed=False)

    def o_proj(model):
        return model.model.layers[0].self_attn.o_proj.weight

    fresh = parts().model  # on by default
    assert not o_proj(fresh).any() and not fresh.model.layers[1].mlp.down_proj.weight.any()
    trained = parts("--zero_init_outputs", "0").model  # MiniMind's initialisation
    assert o_proj(trained).any()
    torch.save(trained.state_dict(), tmp_path / "init.pth")
    loaded = parts("--from_weight", str(tmp_path / "init.pth")).model
    assert torch.equal(o_proj(loaded), o_proj(trained))
