"""trainer/trainer_utils.py, the module MiniMind users look for: it re-exports the
distributed, sampler and checkpoint entry points, and its lm_checkpoint saves and loads.
(That nothing imports it back in a cycle is tests/test_layers.py's.)"""
from pathlib import Path

import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer import trainer_utils
from trainer.trainer_utils import lm_checkpoint


def test_reexports_what_minimind_users_look_for():
    for name in ("init_distributed_mode", "is_main_process", "Logger", "ResumableDistributedSampler",
                 "lm_checkpoint", "save_checkpoint", "load_latest_checkpoint", "get_lr", "setup_seed", "init_model"):
        assert callable(getattr(trainer_utils, name)), name


def test_lm_checkpoint_saves_then_loads_the_latest(tmp_path):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    state = {"scaler": {}, "global_step": 7, "epoch": 0, "step_in_epoch": 7, "samples_per_step": 4,
             "world_size": 1, "model_config": config.to_dict(), "tokens_seen": 224}

    path = lm_checkpoint(str(tmp_path), "run_64", model, optimizer, state=state)
    assert Path(path).name == "run_64_resume_step0000007.pth"

    loaded = lm_checkpoint(str(tmp_path), "run_64", model_config=config.to_dict())
    assert loaded["path"] == path
    assert (loaded["global_step"], loaded["tokens_seen"]) == (7, 224)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert lm_checkpoint(str(tmp_path), "other_64", model_config=config.to_dict()) is None
