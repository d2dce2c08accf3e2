"""trainer/trainer_utils.py, the module MiniMind users look for: each of its entry points is
the very function the trainer uses (not a copy that could drift), and its lm_checkpoint
writes what the trainer resumes and reads what the trainer writes. (That nothing imports
it back in a cycle is tests/test_imports_and_bounds.py's.)"""
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support.jobs import run_trainer
from tests.support.run_outputs import checkpoint_name, latest_checkpoint, out_args
from tests.support.tiny import TINY
from trainer import loop, resume_config, schedule, trainer_utils
from trainer.trainer_utils import lm_checkpoint

# entry point: (the module whose global the trainer calls it through, that global's name);
# get_lr is MiniMind's name for the cosine schedule, which the trainer calls as cosine_lr
WHERE_THE_TRAINER_LOOKS = {"get_lr": (schedule, "cosine_lr"), "model_config": (resume_config, "model_config"),
                           "lm_checkpoint": None}


def test_every_entry_point_is_the_one_the_trainer_calls(tmp_path, monkeypatch):
    """Wrap each entry point where the trainer looks it up, train two steps, and see every
    wrapper called: an entry point the trainer did not use (a stale copy) would fail here.
    get_lr is MiniMind's cosine, so the run takes --lr_schedule cosine (a new run's default is wsd)."""
    calls = {}
    for name in trainer_utils.__all__:
        where = WHERE_THE_TRAINER_LOOKS.get(name, (loop, name))
        if where is None:
            continue  # lm_checkpoint: the round trips below
        owner, looked_up = where
        function = getattr(owner, looked_up)
        assert function is getattr(trainer_utils, name), f"trainer_utils.{name} is not the trainer's {looked_up}"

        def spy(*args, _function=function, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _function(*args, **kwargs)
        monkeypatch.setattr(owner, looked_up, spy)
    run = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "2", "--lr_schedule", "cosine"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    expected = [n for n in trainer_utils.__all__ if WHERE_THE_TRAINER_LOOKS.get(n, ()) is not None]
    assert sorted(calls) == sorted(expected), f"never called by the trainer: {set(expected) - set(calls)}"


def test_lm_checkpoint_reads_what_the_trainer_wrote(tmp_path):
    run = run_trainer([*TINY, *out_args(tmp_path), "--max_steps", "4", "--save_interval", "2"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    loaded = lm_checkpoint(str(tmp_path / "ckpt"), "pretrain_64", model_config=config.to_dict())
    trainer_wrote = latest_checkpoint(tmp_path)
    assert loaded["global_step"] == trainer_wrote["global_step"] == 4
    for name, tensor in trainer_wrote["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert lm_checkpoint(str(tmp_path / "ckpt"), "other_64", model_config=config.to_dict()) is None


def test_the_trainer_resumes_what_lm_checkpoint_wrote(tmp_path):
    """A MiniMind-style script that builds the model and optimizer as the trainer does saves
    with lm_checkpoint; the trainer takes over from it."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer

    base = [*TINY, *out_args(tmp_path), "--optimizer", "adamw", "--max_steps", "4", "--save_interval", "2"]
    first = run_trainer([*base, "--max_steps", "2"], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    saved = latest_checkpoint(tmp_path)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    model = MiniMindForCausalLM(config)
    optimizer = build_optimizer(model, TrainConfig.of(optimizer="adamw", learning_rate=2e-3, weight_decay=0.01,
                                                       adam_betas=(0.9, 0.95)).optim)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    state = {k: saved[k] for k in ("scaler", "global_step", "epoch", "step_in_epoch", "samples_per_step",
                                   "world_size", "tokens_seen", "wandb_run_id", "rng")}
    path = lm_checkpoint(str(tmp_path / "script"), "pretrain_64", model, optimizer, state=state)
    assert path.endswith(checkpoint_name(2))
    resumed = run_trainer([*base, "--checkpoint_dir", str(tmp_path / "script"), "--from_resume", "1"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resumed from {path} at step 2/4" in resumed.stdout
